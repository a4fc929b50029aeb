"""The comparison's four plots: test BLEU against decoding speed and against KV-cache size
(each with its Pareto frontier), Δ BLEU against MHA per configuration with its intervals,
and the validation curves."""

from __future__ import annotations

from pathlib import Path

from multihead.analysis.against_mha import paired_deltas
from multihead.analysis.report import LOWER_IS_BETTER, Report, pareto_frontier
from multihead.analysis.runs import CURVE_KEYS, RunResult, number, seed_groups, value
from multihead.analysis.significance import t_interval


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
