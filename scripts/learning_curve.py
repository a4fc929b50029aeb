"""BLEU against wall-clock minutes: python scripts/learning_curve.py run=RUN_DIR out=DIR.

Translates the split with every ``minute*-step*.ckpt`` checkpoint of the run and writes
learning_curve.md (tables of test scores and of validation BLEU by minute), learning_curve.csv
and learning_curve.png into DIR.
"""

from pathlib import Path

from multihead.cli import exit_on_user_error

import hydra
from omegaconf import DictConfig

from multihead.analysis.learning_curve import learning_curve


@hydra.main(version_base="1.3", config_path="../configs", config_name="learning_curve")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    existing = Path(cfg.out) / "learning_curve.md"
    if existing.exists():
        raise FileExistsError(f"out={cfg.out} already holds {existing.name}; choose a new out=")
    _, scored, paths = learning_curve(
        cfg.run,
        cfg.out,
        split=cfg.split,
        beam_size=cfg.beam_size,
        batch_size=cfg.batch_size,
        limit=cfg.limit,
        local_dir=cfg.data.local_dir,
    )
    for row in scored:
        print(
            f"{row['minutes']:g} min (step {row['step']}): BLEU {row['bleu']:.2f}, "
            f"lc tok {row['bleu_lc_tok']:.2f}, chrF {row['chrf']:.2f}"
        )
    print(f"wrote {', '.join(str(p) for p in paths)}")


if __name__ == "__main__":
    main()
