"""The comparison as a wandb run of its own (job type ``comparison``): its tables (the runs,
the configurations over seeds, the equal terms) and its plots."""

from __future__ import annotations

import logging
from pathlib import Path

from multihead.analysis.runs import RunResult
from multihead.wandb_setup import configure_wandb_mode, finish_wandb

log = logging.getLogger(__name__)


def log_comparison(
    tables: dict[str, tuple[list[str], list[list]]],
    paths: list[Path],
    *,
    group: str | None,
    project: str,
    entity: str | None,
    config: dict,
) -> str:
    """Log ``tables`` (name -> (columns, rows)) as ``wandb.Table`` s and the PNGs of ``paths``
    as images to a wandb run of its own (job type ``comparison``) in ``group``, beside the
    runs it compares. Offline without an API key. Returns the run's path or offline
    directory."""
    import wandb

    out = paths[0].parent
    configure_wandb_mode(str(out))
    run = wandb.init(
        project=project,
        entity=entity,
        group=group,
        name=f"comparison-{group}" if group else "comparison",
        job_type="comparison",
        dir=str(out),
        config=config,
    )
    try:
        logged = {}
        for name, (fields, rows) in tables.items():
            if rows:
                cells = [
                    [c if isinstance(c, (int, float)) or c is None else str(c) for c in row]
                    for row in rows
                ]
                logged[name] = wandb.Table(columns=fields, data=cells)
        for path in paths:
            if path.suffix == ".png":
                logged[path.stem] = wandb.Image(str(path))
        run.log(logged)
        where = run.dir if run.settings.mode == "offline" else run.path
    finally:
        finish_wandb()
    return str(where)


def runs_wandb_group(runs: list[RunResult]) -> str | None:
    """The wandb group the runs were logged in, as each recorded it (``run/wandb_group`` in
    its summary), if they share one.

    Not read from the saved ``.hydra/config.yaml``: Hydra saves it unresolved, and a sweep's
    group (``${path_name:${hydra:sweep.dir}}``) resolves only inside the sweep's own jobs.
    """
    groups = {run.get("run/wandb_group") for run in runs} - {None}
    lacking = [run.label for run in runs if run.get("run/wandb_group") is None]
    if lacking:
        log.warning(
            f"wandb=true: {len(lacking)} of {len(runs)} runs record no run/wandb_group "
            f"(summaries from before it was kept; first: {lacking[0]}), so the comparison's "
            "group is missing; give wandb_group=NAME"
        )
    elif len(groups) > 1:
        log.warning(
            f"wandb=true: the runs record {len(groups)} wandb groups "
            f"({', '.join(sorted(groups))}); "
            "the comparison is logged without one; give wandb_group=NAME"
        )
    return groups.pop() if len(groups) == 1 else None
