"""Export a checkpoint for deployment: python scripts/export.py ckpt=PATH format=ctranslate2 out=DIR

Writes a CTranslate2 model directory (weights, vocabulary, tokenizer, a README with the
Python that translates with it) atomically: a failed export leaves ``out`` as it was.
"""

from multihead.cli import exit_on_user_error

import hydra
from omegaconf import DictConfig

from multihead.deploy.export import FORMATS, export_ctranslate2


@hydra.main(version_base="1.3", config_path="../configs", config_name="export")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    if cfg.format not in FORMATS:
        raise ValueError(f"unknown format {cfg.format!r}; expected one of {', '.join(FORMATS)}")
    out = export_ctranslate2(ckpt=cfg.ckpt, out=cfg.out, overwrite=cfg.overwrite)
    print(f"exported {cfg.ckpt} to {out} ({cfg.format}); see {out}/README.md")


if __name__ == "__main__":
    main()
