"""Compare finished training runs: one table row per run, ratios against MHA, and plots.

What ``scripts/compare.py`` does. Runs come from a directory (any directory below which run
directories hold a ``summary.json``, e.g. a Hydra multirun directory) or from a wandb group
through the public API. Validation curves are read from the run's ``csv/metrics.csv``
(written by default beside wandb, ``logger=wandb_csv``), or from wandb's public API for
a group of online runs.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multihead.wandb_setup import has_wandb_api_key

SUMMARY_FILE = "summary.json"
CURVE_KEYS = ("val/bleu", "val/loss")
STEP_KEY = "trainer/global_step"  # Lightning's step, the ``step`` column of metrics.csv
KIND_ORDER = {"mha": 0, "gqa": 1, "mqa": 2, "mla": 3}
OUTPUT_FILES = (
    "comparison.md",
    "comparison.csv",
    "bleu_vs_decode_speed.png",
    "bleu_vs_kv_cache.png",
    "validation_curves.png",
)
MISSING = "–"

# A curve: (step, value) pairs sorted by step.
Curve = list[tuple[int, float]]


@dataclass
class RunResult:
    """One run: its ``summary.json`` figures and its validation curves.

    ``source`` says where it came from (a run directory or a wandb run path) and
    ``curve_source`` where the curves came from: ``csv``, ``wandb-api``
    or ``none``.
    """

    source: str
    summary: dict[str, Any]
    curves: dict[str, Curve] = field(default_factory=dict)
    curve_source: str = "none"
    label: str = ""

    def get(self, key: str) -> Any:
        return self.summary.get(key)

    @property
    def seed(self) -> Any:
        return self.summary.get("seed")


# ---------------------------------------------------------------------------------------
# Reading runs


def find_run_dirs(root: str | os.PathLike) -> list[Path]:
    """Every directory at or below ``root`` that holds a ``summary.json``, sorted."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(
            f"runs={root}: no such directory (expected a multirun or run directory "
            f"containing {SUMMARY_FILE} files)"
        )
    dirs = sorted({p.parent for p in root.rglob(SUMMARY_FILE) if p.is_file()})
    if not dirs:
        raise FileNotFoundError(
            f"runs={root}: no {SUMMARY_FILE} found below it (expected the directory of "
            "finished training runs, e.g. outputs/train/multiruns/<time>)"
        )
    return dirs


def read_metrics_csv(path: str | os.PathLike) -> dict:
    """``{key: [(step, value), ...]}`` from a Lightning CSVLogger ``metrics.csv``."""
    with open(path, newline="") as f:
        return curves_from_rows(csv.DictReader(f), step_key="step")


def curves_from_rows(rows: Iterable[dict[str, Any]], step_key: str = STEP_KEY) -> dict[str, Curve]:
    """``{key: [(step, value), ...]}`` of CURVE_KEYS by step, from metrics.csv or wandb rows.

    Rows are sparse (each logging call writes its own row), so empty cells are skipped.
    """
    curves: dict[str, Curve] = {}
    for row in rows:
        step = _number(row.get(step_key, row.get("_step")))
        for key in CURVE_KEYS:
            value = _number(row.get(key))
            if step is not None and value is not None:
                curves.setdefault(key, []).append((int(step), value))
    return {key: sorted(points) for key, points in curves.items()}


def load_local_runs(root: str | os.PathLike) -> list[RunResult]:
    """Every run below ``root`` (see ``find_run_dirs``): its ``summary.json`` and, from
    ``csv/metrics.csv`` when there is one, its validation curves; labelled and sorted."""
    runs = []
    for run_dir in find_run_dirs(root):
        try:
            summary = json.loads((run_dir / SUMMARY_FILE).read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{run_dir / SUMMARY_FILE}: not valid JSON ({err})") from None
        if "seed" not in summary:  # runs from before summary.json recorded it
            summary["seed"] = hydra_seed(run_dir)
        runs.append(RunResult(source=str(run_dir), summary=summary))
        metrics_csv = run_dir / "csv" / "metrics.csv"
        if metrics_csv.is_file():
            runs[-1].curves, runs[-1].curve_source = read_metrics_csv(metrics_csv), "csv"
    return label_and_sort(runs, root=Path(root))


def hydra_seed(run_dir: Path) -> Any:
    """The ``seed`` of the config Hydra saved in ``run_dir/.hydra``; ``None`` without one."""
    saved = run_dir / ".hydra" / "config.yaml"
    if not saved.is_file():
        return None
    from omegaconf import OmegaConf

    return OmegaConf.load(saved).get("seed")


def load_wandb_group(group: str, project: str, entity: str | None = None) -> list[RunResult]:
    """The runs of a wandb group, through the public API (needs network and an API key)."""
    if os.environ.get("WANDB_MODE") in ("offline", "disabled") or not has_wandb_api_key():
        raise ValueError(
            f"group={group} reads runs from the wandb API, which needs an API key and "
            "WANDB_MODE unset or online; for offline runs use runs=PATH"
        )
    import wandb

    path = f"{entity}/{project}" if entity else project
    try:
        api_runs = list(wandb.Api().runs(path, filters={"group": group}))
        runs = []
        for api_run in api_runs:
            summary = {k: v for k, v in api_run.summary_metrics.items() if not k.startswith("_")}
            summary.setdefault("run_name", api_run.name)
            summary.setdefault("seed", api_run.config.get("seed"))
            rows = []
            for key in CURVE_KEYS:  # one call per key: history(keys=...) keeps rows with all keys
                rows += api_run.history(keys=[STEP_KEY, key], pandas=False)
            run = RunResult(source=f"{path}/{api_run.id}", summary=summary)
            run.curves, run.curve_source = curves_from_rows(rows), "wandb-api"
            runs.append(run)
    except wandb.errors.CommError as err:
        raise ValueError(f"wandb API, project {path}: {err}") from None
    if not runs:
        raise ValueError(f"wandb project {path} has no runs in group {group!r}")
    return label_and_sort(runs)


def label_and_sort(runs: list[RunResult], root: Path | None = None) -> list[RunResult]:
    """Sort by heads, then K/V heads (MHA, GQA, MQA), backend; label runs by run_name.

    Runs sharing a run_name (seeds, repeated sweeps) get their directory appended.
    """

    def sort_key(run: RunResult):
        heads = _number(run.get("num_heads"))
        kv = _number(run.get("num_kv_heads"))
        return (
            heads if heads is not None else math.inf,
            KIND_ORDER.get(run.get("kind"), len(KIND_ORDER)),
            -kv if kv is not None else math.inf,
            str(run.get("backend") or ""),
            str(run.get("run_name") or ""),
            run.source,
        )

    runs = sorted(runs, key=sort_key)
    names = [str(run.get("run_name") or Path(run.source).name) for run in runs]
    for run, name in zip(runs, names, strict=True):
        run.label = name
        if names.count(name) > 1:
            where = Path(run.source)
            if root is not None and where.is_relative_to(root):
                where = where.relative_to(root)
            run.label = f"{name} [{where}]"
    return runs


# ---------------------------------------------------------------------------------------
# Seeds: runs that share a run name


def has_repeats(runs: list[RunResult]) -> bool:
    """Whether some configuration (run name) was run more than once, e.g. with two seeds."""
    names = [run.get("run_name") for run in runs]
    return len(set(names)) < len(names)


def seed_groups(runs: list[RunResult]) -> dict[str, list[RunResult]]:
    """The runs by run name, in the order of ``runs``."""
    groups: dict[str, list[RunResult]] = {}
    for run in runs:
        groups.setdefault(str(run.get("run_name") or run.label), []).append(run)
    return groups


def seed_means(runs: list[RunResult]) -> list[RunResult]:
    """One result per run name whose numeric figures are the means over its runs.

    Text figures are the first run's; ``test/bleu_min``, ``test/bleu_max`` and ``seeds``
    say how far the runs spread. A figure missing from any run of a group is left as the
    first run's.
    """
    means = []
    for name, group in seed_groups(runs).items():
        summary = dict(group[0].summary)
        for key in summary:
            numbers = [_number(run.get(key)) for run in group]
            if not isinstance(summary[key], str) and None not in numbers:
                summary[key] = statistics.fmean(numbers)
        bleus = [b for run in group if (b := _number(run.get("test/bleu"))) is not None]
        if bleus:
            summary["test/bleu_min"], summary["test/bleu_max"] = min(bleus), max(bleus)
        summary["seed"], summary["seeds"] = None, [run.seed for run in group]
        label = f"{name} ({len(group)} runs)" if len(group) > 1 else name
        means.append(
            RunResult(source=", ".join(run.source for run in group), summary=summary, label=label)
        )
    return means


def paired_deltas(group: list[RunResult], runs: list[RunResult]) -> list[float]:
    """Test BLEU minus that of the MHA run of the same seed and heads, per run of ``group``
    that has one (runs without a seed pair with nothing)."""
    deltas = []
    for run in group:
        base = mha_baseline(run, runs)
        if base is None or run.seed is None or base.seed != run.seed:
            continue
        mine, theirs = _number(run.get("test/bleu")), _number(base.get("test/bleu"))
        if mine is not None and theirs is not None:
            deltas.append(mine - theirs)
    return deltas


def seed_means_markdown(runs: list[RunResult]) -> str:
    """The section of ``comparison.md`` that averages each configuration over its seeds."""
    headers = [
        "configuration",
        "runs",
        "test BLEU",
        "min–max",
        "Δ vs MHA, paired",
        "Δ per seed",
        "KV-cache bytes/token",
        "params",
        "train tgt tok/s",
        "greedy sent/s",
        "beam sent/s",
    ]
    rows = []
    for (name, group), mean in zip(seed_groups(runs).items(), seed_means(runs), strict=True):
        deltas = paired_deltas(group, runs)
        low, high = mean.get("test/bleu_min"), mean.get("test/bleu_max")
        rows.append(
            [
                name,
                str(len(group)),
                format_cell(mean.get("test/bleu"), ".2f"),
                MISSING if low is None else f"{low:.2f}–{high:.2f}",
                format_cell(statistics.fmean(deltas) if deltas else None, "+.2f"),
                ", ".join(f"{d:+.2f}" for d in deltas) or MISSING,
                format_cell(mean.get("kv_cache/bytes_per_token"), ",d"),
                format_cell(mean.get("params/total"), ",d"),
                format_cell(mean.get("perf/train_tgt_tokens_per_s"), ",.0f"),
                format_cell(mean.get("decode/greedy_sentences_per_s"), ",.1f"),
                format_cell(value(mean, "beam"), ",.1f"),
            ]
        )
    return "\n".join(
        [
            "\n## Means over seeds\n",
            "Runs that share a run name are one configuration run with different seeds. "
            "Δ is paired: each run's test BLEU minus that of the MHA run with the same seed "
            "and number of heads. The plots and the frontiers use these means.\n",
            markdown_table(headers, rows),
        ]
    )


# ---------------------------------------------------------------------------------------
# The table


# The table's columns: (header, summary key, format). The key ``beam`` means the
# decode/beam<k>_sentences_per_s key, whatever k is.
COLUMNS = (
    ("kind", "kind", "s"),
    ("heads tag", "tag", "s"),
    ("heads", "num_heads", "d"),
    ("heads active", "heads/active_fraction", ".2f"),
    ("kv heads", "num_kv_heads", "d"),
    ("backend", "backend", "s"),
    ("params", "params/total", ",d"),
    ("attention params", "params/attention", ",d"),
    ("KV-cache bytes/token", "kv_cache/bytes_per_token", ",d"),
    ("train tgt tok/s", "perf/train_tgt_tokens_per_s", ",.0f"),
    ("greedy sent/s", "decode/greedy_sentences_per_s", ",.1f"),
    ("beam sent/s", "beam", ",.1f"),
    ("peak MB", "perf/peak_memory_mb", ",.0f"),
    ("val BLEU", "val/bleu", ".2f"),
    ("test BLEU", "test/bleu", ".2f"),
)

# Ratios against the MHA run with the same number of heads: (header, key, kind).
RATIOS = (
    ("KV-cache ×", "kv_cache/bytes_per_token", "ratio"),
    ("attention params ×", "params/attention", "ratio"),
    ("train tok/s ×", "perf/train_tgt_tokens_per_s", "ratio"),
    ("greedy ×", "decode/greedy_sentences_per_s", "ratio"),
    ("beam ×", "beam", "ratio"),
    ("test BLEU Δ", "test/bleu", "diff"),
)

_BEAM_KEY = re.compile(r"decode/beam(\d+)_sentences_per_s")


def beam_key(summary: dict[str, Any]) -> str | None:
    """The summary key of beam-search speed, e.g. ``decode/beam5_sentences_per_s``."""
    return next((k for k in sorted(summary) if _BEAM_KEY.fullmatch(k)), None)


def value(run: RunResult, key: str) -> Any:
    """A figure of ``run`` by column key; ``None`` when missing."""
    if key == "beam":
        key = beam_key(run.summary) or ""
    return run.summary.get(key)


def mha_baseline(run: RunResult, runs: list[RunResult]) -> RunResult | None:
    """The MHA run with ``run``'s number of heads, if any: the one with the same seed
    preferred (a paired comparison), then the one with the same backend.

    MHA runs themselves have no baseline: only the other kinds are compared with MHA.
    """
    if run.get("kind") == "mha":
        return None
    candidates = [
        other
        for other in runs
        if other.get("kind") == "mha" and other.get("num_heads") == run.get("num_heads")
    ]
    candidates.sort(key=lambda c: (c.seed != run.seed, c.get("backend") != run.get("backend")))
    return candidates[0] if candidates else None


def ratio_row(run: RunResult, base: RunResult) -> dict[str, float | None]:
    row = {}
    for header, key, kind in RATIOS:
        mine, theirs = _number(value(run, key)), _number(value(base, key))
        if mine is None or theirs is None or (kind == "ratio" and theirs == 0):
            row[header] = None
        else:
            row[header] = mine / theirs if kind == "ratio" else mine - theirs
    return row


def format_cell(raw: Any, fmt: str) -> str:
    if raw is None or (isinstance(raw, float) and math.isnan(raw)):
        return MISSING
    if fmt == "s":
        return str(raw)
    number = _number(raw)
    if number is None:
        return str(raw)
    if fmt.endswith("d"):
        number = round(number)
    return format(number, fmt)


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def comparison_markdown(runs: list[RunResult], source: str) -> str:
    """The text of ``comparison.md``: the runs table, ratios vs MHA, plots, notes."""
    headers = ["run"] + [h for h, _, _ in COLUMNS]
    rows = [[run.label] + [format_cell(value(run, k), f) for _, k, f in COLUMNS] for run in runs]
    parts = [
        f"# Run comparison\n\n{len(runs)} runs from `{source}`.\n",
        markdown_table(headers, rows),
    ]

    beams = sorted({k for run in runs if (k := beam_key(run.summary))})
    if beams:
        parts.append(f"\nbeam sent/s: `{'`, `'.join(beams)}`.")

    ratio_lines = []
    for run in runs:
        base = mha_baseline(run, runs)
        if base is None:
            continue
        ratios = ratio_row(run, base)
        ratio_lines.append(
            [run.label, base.label]
            + [format_cell(ratios[h], "+.2f" if kind == "diff" else ".2f") for h, _, kind in RATIOS]
        )
    if ratio_lines:
        parts.append("\n## Against MHA with the same number of heads\n")
        parts.append(
            "× is this run's figure divided by the MHA run's (KV-cache below 1 is smaller, "
            "speed above 1 is faster); Δ is the difference in BLEU points.\n"
        )
        parts.append(markdown_table(["run", "MHA run"] + [h for h, _, _ in RATIOS], ratio_lines))

    if has_repeats(runs):
        parts.append(seed_means_markdown(runs))
    parts.append(_frontier_lines(seed_means(runs) if has_repeats(runs) else runs))
    parts.append(
        "\n## Plots\n\n![test BLEU vs decoding speed](bleu_vs_decode_speed.png)\n\n"
        "![test BLEU vs KV-cache bytes per token](bleu_vs_kv_cache.png)\n\n"
        "![validation curves](validation_curves.png)\n\n## Sources\n"
    )
    for run in runs:
        parts.append(f"- {run.label}: `{run.source}` (validation curves: {run.curve_source})")
    return "\n".join(parts) + "\n"


def _frontier_lines(runs: list[RunResult]) -> str:
    """The Pareto frontiers of test BLEU against KV-cache bytes and decoding speed."""
    lines = ["\n## Pareto frontiers (test BLEU against ...)\n"]
    for key, what in (
        ("kv_cache/bytes_per_token", "KV-cache bytes per token (fewer is better)"),
        ("decode/greedy_sentences_per_s", "greedy sentences/s (more is better)"),
    ):
        frontier = pareto_frontier(runs, key, lower_is_better=LOWER_IS_BETTER.get(key, False))
        names = ", ".join(run.label for run in frontier) or "no runs with both figures"
        lines.append(f"- {what}: {names}")
    return "\n".join(lines) + "\n"


def write_csv(runs: list[RunResult], path: Path) -> None:
    """Every column, unformatted, plus the ratios vs MHA and each run's source."""
    ratio_headers = [h for h, _, _ in RATIOS]
    fields = ["run", *[h for h, _, _ in COLUMNS], *ratio_headers, "source"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for run in runs:
            row = {"run": run.label, **{h: value(run, k) for h, k, _ in COLUMNS}}
            base = mha_baseline(run, runs)
            ratios = ratio_row(run, base) if base is not None else {}
            row.update({h: ratios.get(h) for h in ratio_headers}, source=run.source)
            writer.writerow({k: "" if v is None else v for k, v in row.items()})


# ---------------------------------------------------------------------------------------
# Plots


def pareto_frontier(runs: list[RunResult], key: str, *, lower_is_better: bool) -> list[RunResult]:
    """The runs no other run beats on both test BLEU and ``key``, in ``key`` order (best
    first): a run is on the frontier when every run at least as good on ``key`` scores a
    lower BLEU."""
    points = [
        (x, y, run)
        for run in runs
        if (x := _number(value(run, key))) is not None
        and (y := _number(value(run, "test/bleu"))) is not None
    ]
    points.sort(key=lambda p: (p[0] if lower_is_better else -p[0], -p[1]))
    frontier, best = [], -math.inf
    for _, y, run in points:
        if y > best:
            frontier.append(run)
            best = y
    return frontier


# Which end of each plotted axis is better: fewer cache bytes, more sentences per second.
LOWER_IS_BETTER = {"kv_cache/bytes_per_token": True}


def plot_bleu_against(runs: list[RunResult], path: Path, panels: list[tuple[str, str]]) -> None:
    """Test BLEU against each ``(key, x label)`` of ``panels``: an annotated scatter each,
    with its Pareto frontier drawn as a step line."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5), squeeze=False)
    for ax, (key, xlabel) in zip(axes[0], panels, strict=True):
        for run in runs:
            x, y = _number(value(run, key)), _number(value(run, "test/bleu"))
            if x is not None and y is not None:
                ax.scatter([x], [y], color="C0")
                if (low := run.get("test/bleu_min")) is not None:  # a seed mean: its spread
                    high = run.get("test/bleu_max")
                    ax.errorbar([x], [y], yerr=[[y - low], [high - y]], color="C0", capsize=3)
                ax.annotate(
                    run.label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7
                )
        lower = LOWER_IS_BETTER.get(key, False)
        frontier = pareto_frontier(runs, key, lower_is_better=lower)
        if len(frontier) > 1:
            xs = [_number(value(run, key)) for run in frontier]
            ys = [_number(value(run, "test/bleu")) for run in frontier]
            ax.step(xs, ys, where="post" if lower else "pre", color="C1", label="Pareto frontier")
            ax.legend(fontsize=7)
        if not ax.collections:
            _no_data(ax, f"test BLEU and {xlabel}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test BLEU")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what}", ha="center", va="center", transform=ax.transAxes)


def plot_validation_curves(runs: list[RunResult], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVE_KEYS), figsize=(6 * len(CURVE_KEYS), 4.5))
    for ax, key in zip(axes, CURVE_KEYS, strict=True):
        for run in runs:
            if curve := run.curves.get(key):
                ax.plot(*zip(*curve, strict=True), marker=".", label=run.label)
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            _no_data(ax, f"{key} history")
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_title(key)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------


def write_comparison(runs: list[RunResult], out_dir: str | os.PathLike, source: str) -> list[Path]:
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
    md, table, speed, kv, curves = paths
    md.write_text(comparison_markdown(runs, source))
    write_csv(runs, table)
    speeds = [("decode/greedy_sentences_per_s", "greedy sentences/s"), ("beam", "beam sentences/s")]
    points = seed_means(runs) if has_repeats(runs) else runs
    plot_bleu_against(points, speed, speeds)
    plot_bleu_against(points, kv, [("kv_cache/bytes_per_token", "KV-cache bytes per token")])
    plot_validation_curves(runs, curves)
    return paths


def compare(
    out: str | os.PathLike,
    runs: str | os.PathLike | None = None,
    group: str | None = None,
    project: str = "multihead",
    entity: str | None = None,
) -> tuple[list[RunResult], list[Path]]:
    """Read the runs below ``runs`` or in wandb ``group`` and write the comparison to ``out``."""
    if (runs is None) == (group is None):
        raise ValueError(
            f"give exactly one of runs=PATH or group=NAME (got runs={runs}, group={group})"
        )
    if runs is not None:
        results, source = load_local_runs(runs), str(runs)
    else:
        results = load_wandb_group(group, project, entity)
        source = f"wandb {entity + '/' if entity else ''}{project}, group {group}"
    return results, write_comparison(results, out, source)


def _number(raw: Any) -> float | None:
    """``raw`` as a float, or ``None`` for missing, empty, non-numeric or NaN values."""
    if raw is None or raw == "" or isinstance(raw, bool):
        return None
    try:
        number = float(raw)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number
