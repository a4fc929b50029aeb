"""The comparison's plots (the reported stage): for translation, test BLEU against decoding
speed and against KV-cache size (each with its Pareto frontier), Δ BLEU against MHA per
configuration with its intervals, and the validation curves; for the LM and MQAR, held-out
loss against cache and decoding speed, and each design's learning curves."""

from __future__ import annotations

import statistics
from pathlib import Path

from multihead.analysis.groups import seed_groups
from multihead.analysis.report import LOWER_IS_BETTER, Report, curve_rows, pareto_frontier
from multihead.analysis.runs import CURVE_KEYS, RunResult, number, value
from multihead.analysis.significance import t_interval
from multihead.analysis.tested import paired_deltas


def plot_bleu_against(
    runs: list[RunResult],
    path: Path,
    panels: list[tuple[str, str]],
    bleu_key: str,
    ylabel: str,
    why: str = "",
) -> None:
    """Test BLEU against each ``(key, x label)`` of ``panels``: an annotated scatter each,
    with its Pareto frontier drawn as a step line. Without panels, ``why`` says why not."""
    import matplotlib.pyplot as plt

    panels = panels or [("", "")]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5), squeeze=False)
    for ax, (key, xlabel) in zip(axes[0], panels, strict=True):
        if not key:
            ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, wrap=True)
            continue
        for run in runs:
            x, y = number(value(run, key)), number(value(run, bleu_key))
            if x is not None and y is not None:
                ax.scatter([x], [y], color="C0")
                if (low := run.get(f"{bleu_key}_min")) is not None:  # a seed mean: its spread
                    high = run.get(f"{bleu_key}_max")
                    ax.errorbar([x], [y], yerr=[[y - low], [high - y]], color="C0", capsize=3)
                ax.annotate(
                    run.label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7
                )
        lower = LOWER_IS_BETTER.get(key, False)
        frontier = pareto_frontier(runs, key, lower_is_better=lower, bleu_key=bleu_key)
        if len(frontier) > 1:
            xs = [number(value(run, key)) for run in frontier]
            ys = [number(value(run, bleu_key)) for run in frontier]
            ax.step(xs, ys, where="post" if lower else "pre", color="C1", label="Pareto frontier")
            ax.legend(fontsize=7)
        if not ax.collections:
            _no_data(ax, f"test BLEU and {xlabel}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    _save(fig, path)


def plot_deltas(report: Report, path: Path) -> None:
    """Δ BLEU against MHA per configuration: each seed's paired Δ with its bootstrap
    interval (when tested), and the mean over seeds with its Student-t interval."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = [
        (name, group)
        for name, group in seed_groups(report.runs).items()
        if paired_deltas(group, report.runs, report.bleu_key)
    ]
    for y, (_, group) in enumerate(groups):
        for k, run in enumerate(group):
            if (r := run.paired) is not None:
                err = [[r.delta - r.low], [r.high - r.delta]]
                offset = 0.4 * (k + 1) / (len(group) + 1)  # the seeds just below their mean
                ax.errorbar([r.delta], [y + offset], xerr=err, fmt=".", color="C0", capsize=2)
        deltas = paired_deltas(group, report.runs, report.bleu_key)
        if (interval := t_interval(deltas)) is not None:
            mean, low, high = interval
            ax.errorbar(
                [mean], [y], xerr=[[mean - low], [high - mean]], fmt="s", color="C1", capsize=4
            )
        else:
            ax.plot(deltas, [y] * len(deltas), "s", color="C1")
    if groups:
        ax.axvline(0.0, color="grey", lw=1)
        ax.set_yticks(range(len(groups)), [name for name, _ in groups], fontsize=7)
        ax.set_ylim(len(groups) - 0.5, -0.5)  # the first configuration on top
    else:
        _no_data(ax, "paired runs (an MHA run of the same seed and heads)")
    ax.set_xlabel(f"Δ {report.bleu_name} vs MHA of the same seed")
    ax.set_title("squares: mean over seeds, t 95%; dots: each seed, bootstrap 95%", fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    _save(fig, path)


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
    _save(fig, path)


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt  # imported when a plot is drawn, as above

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_learning_curves(designs, keys: list[str], names: dict[str, str], path: Path) -> None:
    """Each design's mean held-out figure at every evaluation during training, one panel
    per figure (the curves' tables are in the report)."""
    import matplotlib.pyplot as plt

    cols = min(len(keys), 4)
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.5 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        steps, means = curve_rows(designs, key, names)
        for i, (design, values) in enumerate(means.items()):
            points = [(s, v) for s, v in zip(steps, values, strict=True) if v is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker=".", color=f"C{i}", label=design)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys) :]:
        ax.set_visible(False)
    _save(fig, path)


def pareto_setting(speed_rows: list[dict]) -> tuple[int, int] | None:
    """The benchmarked ``(context, batch)`` with the most cached tokens per step (context x
    batch, then the longer context): where the cache weighs most in a step."""
    return max(
        ((r["context"], r["batch"]) for r in speed_rows if r.get("ms")),
        key=lambda setting: (setting[0] * setting[1], setting[0]),
        default=None,
    )


def plot_pareto(lm: dict, names: dict[str, str], speed_rows: list[dict], key: str,
                path: Path) -> None:  # fmt: skip
    """Held-out loss ``key`` (mean over seeds, min-max bars) against KV-cache bytes per token
    and against decoding tokens/s at :func:`pareto_setting`."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    largest = pareto_setting(speed_rows)
    speed = {r["design"]: r for r in speed_rows if (r["context"], r["batch"]) == largest}
    for i, (design, seeds) in enumerate(lm.items()):
        values = [number(r.get(key)) for r in seeds.values() if r.get(key) is not None]
        if not values:
            continue
        label = names[design]
        y = statistics.fmean(values)
        yerr = [[y - min(values)], [max(values) - y]]
        cache = number(next(iter(seeds.values())).get("kv_cache/bytes_per_token"))
        axes[0].errorbar([cache], [y], yerr=yerr, fmt="o", color=f"C{i}", capsize=3, label=label)
        if label in speed:
            r = speed[label]
            x = r["batch"] * 1000 / r["ms"]
            xerr = [[x - r["batch"] * 1000 / r["ms_max"]], [r["batch"] * 1000 / r["ms_min"] - x]]
            axes[1].errorbar([x], [y], xerr=xerr, yerr=yerr, fmt="o", color=f"C{i}", capsize=3,
                             label=label)  # fmt: skip
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("KV-cache bytes per token (fp32, all layers)")
    setting = f"{largest[0]:,} x {largest[1]}" if largest else "no benchmark rows"
    axes[1].set_xlabel(f"decoding tokens/s at context x batch {setting} (min-max of rounds)")
    for ax in axes:
        ax.set_ylabel(f"held-out {key} (nats)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("points: mean over seeds; bars: min-max over seeds (loss), of rounds (speed)")
    _save(fig, path)
