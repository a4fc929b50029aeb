"""Compare training runs: python scripts/compare.py runs=MULTIRUN_DIR out=DIR.

Writes comparison.md (table, ratios vs MHA, paired significance tests against MHA, seed
means with t-intervals and Holm-adjusted verdicts, the equal terms, the learning-rate grid,
the declared family, plots), comparison.csv and the PNG plots into DIR (for LM and MQAR
runs: long_context.md and its CSVs, the learning curves and the Pareto plot).
``family=FILE`` reads the tests declared before the runs. ``group=NAME [project=...]
[entity=...]`` reads a wandb group instead (online only). ``speed=true`` measures every
run's speeds again side by side and keeps them in each run's speed.json; ``wandb=true``
logs the comparison to a wandb run of its own. See configs/compare.yaml for every option.
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
        cfg.out,
        runs=cfg.runs,
        group=cfg.group,
        project=cfg.project,
        entity=cfg.entity,
        hypotheses=cfg.hypotheses,
        references=cfg.references,
        local_dir=cfg.local_dir,
        significance=OmegaConf.to_container(cfg.significance),
        speed=cfg.speed,
        speed_options=OmegaConf.to_container(cfg.speed_options),
        checkpoint=cfg.checkpoint,
        wandb_log=cfg.wandb,
        wandb_group=cfg.wandb_group,
        equivalence_margin=cfg.equivalence_margin,
        long_context=cfg.long_context,
        pool_despite=_listed(cfg.pool_despite),
        split_by=_listed(cfg.split_by),
        grid=OmegaConf.to_container(cfg.grid),
        family=cfg.family,
        longer=cfg.longer,
    )
    for run in runs:
        print(f"{run.label}: {run.source} (validation curves: {run.curve_source})")
    print(f"compared {len(runs)} runs; wrote {', '.join(str(p) for p in paths)}")


def _listed(value):
    return OmegaConf.to_container(value) if OmegaConf.is_list(value) else value


if __name__ == "__main__":
    main()
