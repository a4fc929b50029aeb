"""Compare finished training runs: what ``scripts/compare.py`` does, from reading the runs
to writing ``comparison.md``, ``comparison.csv`` and the plots, and logging them to wandb.

Each job has its module: :mod:`~multihead.analysis.runs` reads the runs (a directory of run
directories, or a wandb group), :mod:`~multihead.analysis.against_mha` tests them against
MHA (per seed and over seeds), :mod:`~multihead.analysis.speed` measures them side by side,
:mod:`~multihead.analysis.report` writes the tables, :mod:`~multihead.analysis.plots` the
plots and :mod:`~multihead.analysis.wandb_log` the wandb run. This module runs them in
order.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from multihead.analysis.against_mha import HYPOTHESES_FILE, add_significance
from multihead.analysis.lm_comparison import is_lm_run, read_speed_rows, write_lm_comparison
from multihead.analysis.plots import plot_bleu_against, plot_deltas, plot_validation_curves
from multihead.analysis.report import Report, comparison_markdown, make_report, write_csv
from multihead.analysis.runs import (
    RunResult,
    check_seed_configs,
    load_local_runs,
    load_wandb_group,
    pooled_despite_note,
    refuse_unused_pool_despite,
    write_speed_record,
)
from multihead.analysis.wandb_log import log_comparison, log_to_wandb, runs_wandb_group
from multihead.attention.checks import check_bool

OUTPUT_FILES = (
    "comparison.md",
    "comparison.csv",
    "bleu_vs_decode_speed.png",
    "bleu_vs_kv_cache.png",
    "validation_curves.png",
    "delta_vs_mha.png",
)


def write_comparison(report: Report, out_dir: str | os.PathLike) -> list[Path]:
    """Write the files named in ``OUTPUT_FILES`` into ``out_dir`` (created if needed).

    Only those files are written; earlier copies of them are overwritten, nothing else in
    ``out_dir`` is touched. Returns their paths.
    """
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"out={out} is a file; expected a directory for the comparison")
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / name for name in OUTPUT_FILES]
    md, table, speed, kv, curves, deltas = paths
    md.write_text(comparison_markdown(report))
    write_csv(report, table)
    speeds = report.speeds
    panels = []
    if speeds is not None:
        panels = [
            (speeds["greedy"], f"greedy sentences/s ({speeds['as']})"),
            (speeds["beam"], f"beam sentences/s ({speeds['as']})"),
        ]
    why = (
        f"speeds measured in training left out\n(overlap: {report.overlap[0]})\n"
        "measure them with compare.py speed=true"
    )
    plot_bleu_against(report.points, speed, panels, report.bleu_key, report.bleu_name, why)
    kv_panel = [("kv_cache/bytes_per_token", "KV-cache bytes per token")]
    plot_bleu_against(report.points, kv, kv_panel, report.bleu_key, report.bleu_name)
    plot_validation_curves(report.runs, curves)
    plot_deltas(report, deltas)
    return paths


def compare(
    out: str | os.PathLike,
    runs: str | os.PathLike | None = None,
    group: str | None = None,
    project: str = "multihead",
    entity: str | None = None,
    *,
    hypotheses: str = HYPOTHESES_FILE,
    references: str | None = None,
    local_dir: str | None = None,
    significance: dict[str, Any] | None = None,
    speed: bool = False,
    speed_options: dict[str, Any] | None = None,
    checkpoint: str | None = None,
    wandb_log: bool = False,
    wandb_group: str | None = None,
    equivalence_margin: float | None = None,
    long_context: str | os.PathLike | None = None,
    pool_despite: Sequence[str] = (),
) -> tuple[list[RunResult], list[Path]]:
    """Read the runs below ``runs`` or in wandb ``group`` and write the comparison to ``out``.

    ``significance``: the options of :func:`add_significance` (test, metric, samples, lang).
    ``local_dir``: where the raw corpus is (test references, speed); ``None``: the runs'.
    ``speed``: also measure every run side by side (:func:`multihead.analysis.speed.measure`
    with ``speed_options``), decoding each run's ``checkpoint`` (a path relative to the run
    directory; ``None``: the checkpoint its test used, ``test/ckpt``), and keep the figures
    in each run's ``speed.json``, where a later comparison reads them. ``wandb_log``: log
    the comparison to a wandb run of its own in ``wandb_group`` (``None``: ``group``, or
    the runs' own ``wandb_group``). ``equivalence_margin``: the BLEU difference within
    which a design counts as equal to MHA if the TOST says so; ``None``: no such test.
    ``long_context``: the rows ``scripts/benchmark_long_context.py --json`` wrote, for the
    section on what each design buys at long context; ``None``: no such section.
    ``pool_despite``: config keys in which seeds of one run name may differ
    (:func:`check_seed_configs`); the report names those that did.
    """
    check_bool("speed", speed)
    check_bool("wandb", wandb_log)  # the script's name for it
    if isinstance(pool_despite, str) or not all(isinstance(k, str) for k in pool_despite):
        raise ValueError(
            f"pool_despite={pool_despite!r}: expected a list of config keys, "
            "e.g. pool_despite=[module.scheduler.decay]"
        )
    if (runs is None) == (group is None):
        raise ValueError(
            f"give exactly one of runs=PATH or group=NAME (got runs={runs}, group={group})"
        )
    if runs is not None:
        results, source = load_local_runs(runs), str(runs)
    else:
        results = load_wandb_group(group, project, entity)
        source = f"wandb {entity + '/' if entity else ''}{project}, group {group}"
    lm = [run for run in results if is_lm_run(run)]
    if lm:  # the long-context comparison: decoder-only LMs and MQAR
        if len(lm) != len(results):
            raise ValueError(
                f"{len(lm)} of the {len(results)} runs are decoder-only LM or MQAR runs: "
                "compare them apart from translation runs"
            )
        speed_rows = read_speed_rows(long_context)
        paths = write_lm_comparison(results, out, speed_rows, pool_despite)
        if wandb_log:
            target = wandb_group or group or runs_wandb_group(results)
            fields, *rows = list(csv.reader(paths[1].open()))
            log_comparison(
                {"long_context": (fields, rows)}, paths, group=target, project=project,
                entity=entity, config={"source": source, "runs": len(results)},
            )  # fmt: skip
        return results, paths
    despite = check_seed_configs(results, pool_despite)  # a run name: seeds of one config
    refuse_unused_pool_despite(pool_despite, despite)
    long_context_rows = None if long_context is None else read_long_context(long_context)
    notes = add_significance(
        results,
        hypotheses=hypotheses,
        references=references,
        local_dir=local_dir,
        **(significance or {}),
    )
    if speed:
        from multihead.analysis.speed import measure

        checkpoints = {run.label: run_checkpoint(run, checkpoint) for run in results}
        measured, setup = measure(checkpoints, local_dir=local_dir, **(speed_options or {}))
        for run in results:
            write_speed_record(run, measured[run.label], setup)
    metric = (significance or {}).get("metric", "lc-tok")
    notes += pooled_despite_note(despite)
    report = make_report(results, source, notes, metric, equivalence_margin)
    report.long_context = long_context_rows
    paths = write_comparison(report, out)
    if wandb_log:
        target = wandb_group or group or runs_wandb_group(results)
        log_to_wandb(report, paths, group=target, project=project, entity=entity)
    return results, paths


def read_long_context(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of ``scripts/benchmark_long_context.py --json``, checked in one line."""
    path = Path(path)
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(
            f"long_context={path}: expected the JSON file benchmark_long_context.py --json "
            f"writes ({type(err).__name__}: {err})"
        ) from None
    needed = {"design", "dtype", "context", "batch", "candidate", "ms"}
    if not isinstance(rows, list) or not all(
        isinstance(r, dict) and needed <= r.keys() for r in rows
    ):
        raise ValueError(
            f"long_context={path}: expected a list of rows with {', '.join(sorted(needed))} "
            "(benchmark_long_context.py --json)"
        )
    return rows


def run_checkpoint(run: RunResult, checkpoint: str | None) -> Path:
    """The checkpoint ``speed=true`` decodes for ``run``: ``checkpoint`` relative to the
    run directory, or the one its test used (``test/ckpt`` in its summary)."""
    if run.directory is None:
        raise ValueError(f"speed=true needs runs on disk (runs=PATH); {run.label} is {run.source}")
    if checkpoint is not None:
        path = run.directory / checkpoint
    elif isinstance(run.get("test/ckpt"), str) and run.get("test/ckpt") != "final weights":
        path = run.directory / run.get("test/ckpt")  # an absolute test/ckpt stays itself
    else:
        path = None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"speed=true: no checkpoint for {run.label} at {path or 'test/ckpt (none recorded)'}; "
            "give checkpoint=PATH relative to each run directory (e.g. checkpoints/last.ckpt)"
        )
    return path
