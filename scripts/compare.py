"""Compare training runs: python scripts/compare.py runs=MULTIRUN_DIR out=DIR.

Writes comparison.md (table, ratios vs MHA, plots), comparison.csv and the PNG plots into
DIR. ``group=NAME [project=...] [entity=...]`` reads a wandb group instead (online only).
"""

from multihead.cli import exit_on_user_error

import hydra
from omegaconf import DictConfig, OmegaConf

from multihead.analysis.comparison import compare


@hydra.main(version_base="1.3", config_path="../configs", config_name="compare")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    if OmegaConf.is_missing(cfg, "out"):
        raise ValueError("out=DIR is required: the directory to write the comparison into")
    runs, paths = compare(
        cfg.out, runs=cfg.runs, group=cfg.group, project=cfg.project, entity=cfg.entity
    )
    for run in runs:
        print(f"{run.label}: {run.source} (validation curves: {run.curve_source})")
    print(f"compared {len(runs)} runs; wrote {', '.join(str(p) for p in paths)}")


if __name__ == "__main__":
    main()
