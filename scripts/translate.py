"""Translate sentences: python scripts/translate.py ckpt=PATH [input=FILE] < sentences.txt

Reads one sentence per line (from input= or stdin) and prints one translation per line.
``engine=ctranslate2 model_dir=DIR`` translates with a model exported by ``scripts/export.py``
instead (``compute_type=int8`` quantizes it when loading), under the same length rules.
"""

import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from multihead.training.checkpoint import load_translator
from multihead.training.config import exit_on_user_error
from multihead.training.inference import translate

ENGINES = ("torch", "ctranslate2")


def read_input(path: str | None) -> list[str]:
    if path is None:
        return [line.rstrip("\n") for line in sys.stdin]
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"input file not found: {p}")
    try:
        return p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ValueError(f"{p} is not UTF-8 text (byte {err.start}); expected UTF-8") from None


def check_engine(cfg: DictConfig) -> None:
    """One-line errors for an engine without the file it needs, or with one it ignores."""
    if cfg.engine not in ENGINES:
        raise ValueError(f"unknown engine {cfg.engine!r}; expected one of {', '.join(ENGINES)}")
    needed, other = ("ckpt", "model_dir") if cfg.engine == "torch" else ("model_dir", "ckpt")
    if cfg[needed] is None:
        raise ValueError(f"engine={cfg.engine} needs {needed}=PATH")
    if cfg[other] is not None:
        raise ValueError(f"engine={cfg.engine} reads {needed}=, not {other}= ({cfg[other]})")
    if cfg.engine == "torch" and cfg.compute_type != "default":
        raise ValueError(
            f"compute_type={cfg.compute_type} is for engine=ctranslate2; engine=torch runs "
            "the checkpoint's own float32 weights"
        )


@hydra.main(version_base="1.3", config_path="../configs", config_name="translate")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    check_engine(cfg)
    lines = read_input(cfg.input)
    options = dict(
        beam_size=cfg.beam_size,
        length_penalty=cfg.length_penalty,
        max_len_a=cfg.max_len_a,
        max_len_b=cfg.max_len_b,
        batch_size=cfg.batch_size,
    )
    if cfg.engine == "ctranslate2":
        from multihead.checkpoints.engine import CTranslate2Engine

        if cfg.device != "cpu":
            raise ValueError(f"engine=ctranslate2 runs on device=cpu, got device={cfg.device}")
        engine = CTranslate2Engine(cfg.model_dir, compute_type=cfg.compute_type)
        outputs = engine.translate(lines, **options)
    else:
        translator = load_translator(cfg.ckpt, backend=cfg.backend)
        model = translator.model.to(cfg.device)
        with torch.inference_mode():
            outputs = translate(model, translator.tokenizer, lines, **options)
    for line in outputs:
        print(line)


if __name__ == "__main__":
    main()
