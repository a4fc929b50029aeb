"""Translate sentences: python scripts/translate.py ckpt=PATH [input=FILE] < sentences.txt

Reads one sentence per line (from input= or stdin) and prints one translation per line, a
chunk at a time, with a progress bar on stderr. Blank lines stay blank. A line that is not
UTF-8, or longer than the model's positions, stops with an error naming it.
``engine=ctranslate2 model_dir=DIR`` translates with a model exported by
``scripts/export.py`` instead (``compute_type=int8`` quantizes it when loading), under the
same length rules.
"""

import sys
from pathlib import Path

from multihead.cli import exit_on_user_error

import hydra
import torch
from omegaconf import DictConfig

from multihead.checkpoints import load_trained_model, search_settings
from multihead.evaluation import translate
from multihead.evaluation.stream import read_lines, translate_lines

ENGINES = ("torch", "ctranslate2")


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
    if cfg.engine == "ctranslate2" and cfg.device != "cpu":
        raise ValueError(f"engine=ctranslate2 runs on device=cpu, got device={cfg.device}")


@hydra.main(version_base="1.3", config_path="../configs", config_name="translate")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    check_engine(cfg)
    if cfg.engine == "ctranslate2":
        from multihead.deploy.engine import CTranslate2Engine

        engine = CTranslate2Engine(cfg.model_dir, compute_type=cfg.compute_type)
        run, tokenizer, trained = engine.translate, engine.tokenizer, engine.settings
        max_positions = engine.settings["max_positions"]
    else:
        trained = load_trained_model(cfg.ckpt, backend=cfg.backend)
        model = trained.model.to(cfg.device)
        tokenizer, trained = trained.tokenizer, trained.config

        def run(sentences, **options):
            with torch.inference_mode():
                return translate(model, tokenizer, sentences, **options)

        max_positions = model.max_positions
    options = dict(
        beam_size=cfg.beam_size,
        batch_size=cfg.batch_size,
        **search_settings(
            trained,
            length_penalty=cfg.length_penalty,
            max_len_a=cfg.max_len_a,
            max_len_b=cfg.max_len_b,
        ),
    )

    def translate_chunk(texts: list[str], numbers: list[int]) -> list[str]:
        for number, ids in zip(numbers, tokenizer.encode_batch(texts), strict=True):
            if len(ids) + 1 > max_positions:  # + eos
                raise ValueError(
                    f"line {number} has {len(ids)} subwords; the model reads at most "
                    f"{max_positions - 1}; split the line"
                )
        return run(texts, **options)

    if cfg.input is None:
        lines = read_lines(sys.stdin.buffer, "stdin")
    else:
        path = Path(cfg.input)
        if not path.is_file():
            raise FileNotFoundError(f"input file not found: {path}")
        lines = read_lines(path.open("rb"), str(path))
    for text in translate_lines(lines, translate_chunk, progress=cfg.progress):
        print(text, flush=False)


if __name__ == "__main__":
    main()
