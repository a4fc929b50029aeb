"""Compare finished training runs: what ``scripts/compare.py`` does, one way for every task
(translation, the long-context LM, MQAR), in five stages, each a module that uses only those
before it:

1. loaded (:mod:`~multihead.analysis.runs`): the run directories or a wandb group, with
   their configs, summaries and curves, and the benchmark's rows;
2. grouped (:mod:`~multihead.analysis.groups`): one task, runs without a saved config
   refused, designs named, each design's learning-rate grid and chosen rate, the pools of
   seeds checked (configs, thread count, CPU model);
3. described (:mod:`~multihead.analysis.describe`): each design's equal terms, counted from
   the model its config builds;
4. tested (:mod:`~multihead.analysis.tested`): each design against its baseline, paired by
   seed, Holm over the declared family, the order at the last two evaluations;
5. reported (:mod:`~multihead.analysis.report`, :mod:`~multihead.analysis.plots`,
   :mod:`~multihead.analysis.wandb_log`): markdown, CSV, figures and the wandb run.

Side-by-side speeds (:mod:`~multihead.analysis.speed`, ``speed=true``) are measured between
the loading and the report and kept in each run's directory.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from multihead.analysis.describe import describe_run
from multihead.analysis.groups import (
    Grouped,
    by_design,
    display_names,
    figures,
    group_runs,
    longer_budget,
    pooled_despite_note,
    seed_groups,
    task,
)
from multihead.analysis.plots import (
    plot_bleu_against,
    plot_deltas,
    plot_learning_curves,
    plot_pareto,
    plot_validation_curves,
)
from multihead.analysis.report import (
    ACC_MARGIN,
    LONG_CONTEXT_FILES,
    LOSS_MARGIN,
    Report,
    comparison_markdown,
    equal_terms_rows,
    learning_curve_rows,
    lm_markdown,
    long_context_rows,
    make_report,
    seed_rows,
    table_rows,
    tested_rows,
    write_csv,
)
from multihead.analysis.runs import (
    RunResult,
    load_local_runs,
    load_wandb_group,
    read_long_context,
    read_speed_rows,
    write_speed_record,
)
from multihead.analysis.tested import (
    HYPOTHESES_FILE,
    add_significance,
    bleu_key,
    long_context_tests,
    read_family,
    translation_tests,
    with_longer,
)
from multihead.analysis.wandb_log import log_comparison, runs_wandb_group
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
    split_by: Sequence[str] = (),
    grid: Mapping[str, str] | None = None,
    family: str | os.PathLike | None = None,
    longer: str | os.PathLike | None = None,
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
    ``long_context``: the benchmark's rows (``scripts/benchmark_long_context.py --json``):
    for translation what each design buys, for the LM its trained checkpoints' speeds.
    ``pool_despite``, ``split_by``, ``grid``: as :func:`~multihead.analysis.groups.group_runs`.
    ``family``: the file of tests declared before the runs
    (:func:`~multihead.analysis.tested.read_family`); ``None``: none declared. ``longer``: a
    directory of the compared designs trained longer (one seed is enough): each test says
    whether its order holds there (:func:`~multihead.analysis.groups.longer_budget`).
    """
    check_bool("speed", speed)
    check_bool("wandb", wandb_log)  # the script's name for it
    if (runs is None) == (group is None):
        raise ValueError(
            f"give exactly one of runs=PATH or group=NAME (got runs={runs}, group={group})"
        )
    # 1. Loaded, with everything else the comparison reads, before anything is written.
    if runs is not None:
        results, source = load_local_runs(runs), str(runs)
    else:
        results = load_wandb_group(group, project, entity)
        source = f"wandb {entity + '/' if entity else ''}{project}, group {group}"
    declared = None if family is None else read_family(family)
    longer_results = None if longer is None else load_local_runs(longer, "longer")
    # 2. Grouped.
    grouped = group_runs(results, pool_despite=pool_despite, split_by=split_by, grid=grid)
    trained_longer = (
        {} if longer_results is None else longer_budget(grouped.runs, longer_results, split_by)
    )
    target = wandb_group or group or runs_wandb_group(results) if wandb_log else None
    if grouped.task == "long context":
        speed_rows = None if long_context is None else read_speed_rows(long_context)
        paths = write_long_context(grouped, source, out, speed_rows, declared, trained_longer)
        out_dir = Path(out)
        if wandb_log:
            tables = {name: _csv_table(out_dir / f"{name}.csv") for name in
                      ("long_context", "equal_terms", "learning_curves", "tests")}  # fmt: skip
            log_comparison(
                tables, paths, group=target, project=project, entity=entity,
                config={"source": source, "runs": len(results)},
            )  # fmt: skip
        return results, paths
    long_context_rows = None if long_context is None else read_long_context(long_context)
    chosen = grouped.runs
    # 3. Described.
    described = {name: describe_run(pool[0]) for name, pool in seed_groups(chosen).items()}
    # 4. Tested: per seed by sacreBLEU, then over seeds.
    notes = add_significance(
        chosen,
        hypotheses=hypotheses,
        references=references,
        local_dir=local_dir,
        **(significance or {}),
    )
    if speed:
        from multihead.analysis.speed import measure

        checkpoints = {run.label: run_checkpoint(run, checkpoint) for run in chosen}
        measured, setup = measure(checkpoints, local_dir=local_dir, **(speed_options or {}))
        for run in chosen:
            write_speed_record(run, measured[run.label], setup)
    metric = (significance or {}).get("metric", "lc-tok")
    notes += pooled_despite_note(grouped.despite)
    key = bleu_key(chosen)
    # 5. Reported.
    report = make_report(chosen, source, notes, metric, equivalence_margin, key)
    report.keyed = with_longer(
        translation_tests(chosen, key, equivalence_margin, declared), trained_longer, chosen
    )
    report.grouped, report.described, report.family = grouped, described, declared
    report.long_context = long_context_rows
    paths = write_comparison(report, out)
    if wandb_log:
        log_to_wandb(report, paths, group=target, project=project, entity=entity)
    return results, paths


def _csv_table(path: Path) -> tuple[list[str], list[list[str]]]:
    fields, *rows = list(csv.reader(path.open()))
    return fields, rows


def log_to_wandb(
    report: Report, paths: list[Path], *, group: str | None, project: str, entity: str | None
) -> str:
    """Log the translation comparison to a wandb run of its own (job type ``comparison``) in
    ``group``: the table of runs (``comparison``), the configurations over seeds and the
    contrasts (``seed_means``), the equal terms (``equal_terms``), the plots as images.
    Offline without an API key, as training is. Returns the run's path or offline
    directory."""
    tables = {"comparison": table_rows(report), "seed_means": seed_rows(report)}
    tables["equal_terms"] = equal_terms_rows(report.described)
    tables["learning_curves"] = learning_curve_rows(report.runs)
    tables["tests"] = tested_rows(report.keyed)
    config = {"source": report.source, "runs": len(report.runs), "bleu": report.bleu_name}
    return log_comparison(tables, paths, group=group, project=project, entity=entity, config=config)


def write_long_context(
    grouped: Grouped, source: str, out: str | os.PathLike, speed_rows, family, longer
) -> list[Path]:
    """The LM and MQAR comparison, every stage after grouping: described, tested, and
    written into ``out`` (``long_context.md``, ``long_context.csv``, ``equal_terms.csv``,
    ``learning_curves.csv`` and ``tests.csv``, the learning curves' plots and the LM's
    Pareto plot)."""
    import matplotlib

    matplotlib.use("Agg")
    tasks = {
        kind: by_design([r for r in grouped.runs if task(r) == kind])
        for kind in ("lm", "mqar")
        if any(task(r) == kind for r in grouped.runs)
    }
    keys = {
        kind: (["val/loss", *figures(every, "val/loss@")] if kind == "lm"
               else figures(every, "val/acc@"))
        for kind, designs in tasks.items()
        for every in [[r for seeds in designs.values() for r in seeds.values()]]
    }  # fmt: skip
    # 3. Described: each design's first run's model.
    described = {
        (kind, design): describe_run(next(iter(seeds.values())))
        for kind, designs in tasks.items()
        for design, seeds in designs.items()
    }
    # 4. Tested.
    margins = {"lm": LOSS_MARGIN, "mqar": ACC_MARGIN}
    tests = with_longer(long_context_tests(tasks, keys, margins, family), longer, grouped.runs)
    # 5. Reported.
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"out={out} is a file; expected a directory for the comparison")
    out.mkdir(parents=True, exist_ok=True)
    report = Report(grouped.runs, source, grouped=grouped, described=described, family=family)
    curves = {kind: f"learning_curves_{kind}.png" for kind in tasks}
    names = (*LONG_CONTEXT_FILES, "equal_terms.csv", "learning_curves.csv", "tests.csv")
    paths = [out / name for name in names]
    paths[0].write_text(lm_markdown(tasks, keys, tests, report, speed_rows, curves))
    rows = long_context_rows(tasks, keys)
    with paths[1].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    with paths[2].open("w", newline="") as f:
        writer = csv.writer(f)
        for i, (kind, designs) in enumerate(tasks.items()):
            mine = {d: described[kind, d] for d in designs}
            fields, table = equal_terms_rows(mine, display_names(designs))
            if i == 0:
                writer.writerow(["task", *fields])
            writer.writerows([[kind, *("" if c is None else c for c in row)] for row in table])
    for path, (fields, table) in zip(paths[3:], (learning_curve_rows(grouped.runs),
                                                  tested_rows(tests)), strict=True):  # fmt: skip
        with path.open("w", newline="") as f:
            csv.writer(f).writerows([fields, *([("" if c is None else c) for c in row]
                                               for row in table)])  # fmt: skip
    for kind, designs in tasks.items():
        paths.append(out / curves[kind])
        plot_learning_curves(designs, keys[kind], display_names(designs), paths[-1])
    if "lm" in tasks:
        paths.append(out / "long_context_pareto.png")
        names = display_names(tasks["lm"])
        plot_pareto(tasks["lm"], names, speed_rows or [], keys["lm"][-1], paths[-1])
    return paths


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
