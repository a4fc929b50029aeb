"""Translate sentences: python scripts/translate.py ckpt=PATH [input=FILE] < sentences.txt

Reads one sentence per line (from input= or stdin) and prints one translation per line.
"""

import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from multihead.checkpoints import load_translator
from multihead.cli import exit_on_user_error
from multihead.evaluation import search_settings, translate


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


@hydra.main(version_base="1.3", config_path="../configs", config_name="translate")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    translator = load_translator(cfg.ckpt, backend=cfg.backend)
    lines = read_input(cfg.input)
    model = translator.model.to(cfg.device)
    with torch.inference_mode():
        outputs = translate(
            model,
            translator.tokenizer,
            lines,
            beam_size=cfg.beam_size,
            batch_size=cfg.batch_size,
            **search_settings(
                translator.config,
                length_penalty=cfg.length_penalty,
                max_len_a=cfg.max_len_a,
                max_len_b=cfg.max_len_b,
            ),
        )
    for line in outputs:
        print(line)


if __name__ == "__main__":
    main()
