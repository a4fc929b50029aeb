"""The long-context comparison: what each head design costs in quality and buys in decoding,
for the same trained decoder-only LMs (``experiment=lm_long``) and recall probes
(``experiment=mqar``).

Quality: each design's held-out loss, overall and by position bucket, and MQAR accuracy per
(sequence length, pairs) setting, against the MHA run of the same seed; over seeds the paired
t-test, Holm-adjusted over the designs for each figure, the difference it could have found
(80% power), and TOST against a margin set before the runs. Speed and cache: the rows of
``scripts/benchmark_long_context.py --checkpoints ... --json`` on those runs' checkpoints
(designs interleaved within rounds; median step with the min-max of rounds). Written as
``long_context.md``, ``long_context.csv`` and ``long_context_pareto.png``.
"""

from __future__ import annotations

import csv
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from multihead.analysis.against_mha import SeedTest, seed_family
from multihead.analysis.runs import (
    RunResult,
    check_seed_configs,
    number,
    pooled_despite_note,
    refuse_unused_pool_despite,
)

# Margins for "equal", set before the runs: 0.02 nats of held-out loss (a 2% perplexity
# ratio) and 2 points of MQAR accuracy.
LOSS_MARGIN = 0.02
ACC_MARGIN = 0.02
DESIGN_ORDER = {"mha": 0, "gqa": 1, "mqa": 2, "mla": 3}


def is_lm_run(run: RunResult) -> bool:
    """A run of the decoder-only LM (loss by position) or of MQAR (accuracy by setting)."""
    return any(k.startswith(("val/loss@", "val/acc@")) for k in run.summary)


def task(run: RunResult) -> str:
    return "mqar" if any(k.startswith("val/acc@") for k in run.summary) else "lm"


def _bucket_key(key: str) -> tuple[int, int]:
    name = key.split("@", 1)[1]
    if "x" in name:  # MQAR: SEQxPAIRS
        seq, pairs = name.split("x")
        return int(seq), int(pairs)
    return tuple(int(p) for p in name.split("-"))  # type: ignore[return-value]


def figures(runs: list[RunResult], prefix: str) -> list[str]:
    """The ``prefix@...`` keys the runs share, in bucket or grid order."""
    keys = set.intersection(*({k for k in r.summary if k.startswith(prefix)} for r in runs))
    return sorted(keys, key=_bucket_key)


def by_design(runs: list[RunResult]) -> dict[str, dict[Any, RunResult]]:
    """``{design: {seed: run}}``, a design being a run name (the heads and the design's
    options, e.g. ``lm-mla8r24rope8_sdpa``) shown by its kind where the kind is unique;
    two runs of one design and seed are refused."""
    groups: dict[str, dict[Any, RunResult]] = {}
    for run in runs:
        seeds = groups.setdefault(str(run.get("run_name")), {})
        if run.seed in seeds:
            raise ValueError(
                f"two {run.get('run_name')} runs with seed {run.seed}: {seeds[run.seed].source} "
                f"and {run.source}; compare one run per design and seed"
            )
        seeds[run.seed] = run
    kinds = [str(next(iter(s.values())).get("kind")) for s in groups.values()]
    named = {
        (kind if kinds.count(kind) == 1 else f"{kind} ({name})"): seeds
        for kind, (name, seeds) in zip(kinds, groups.items(), strict=True)
    }
    return dict(sorted(named.items(), key=lambda kv: DESIGN_ORDER.get(kv[0].split()[0], 9)))


def tests_against_mha(
    designs: dict[str, dict[Any, RunResult]], key: str, margin: float
) -> dict[str, SeedTest]:
    """Per design other than MHA, its ``key`` minus MHA's of the same seed, tested over
    seeds; Holm over the designs."""
    mha = designs.get("mha", {})
    deltas = {}
    for design, seeds in designs.items():
        if design == "mha":
            continue
        found = [
            number(run.get(key)) - number(mha[seed].get(key))
            for seed, run in seeds.items()
            if seed in mha and run.get(key) is not None and mha[seed].get(key) is not None
        ]
        if found:
            deltas[design] = found
    return seed_family(deltas, margin)


def _mean_sd(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"


def _test_cells(test: SeedTest | None, digits: int = 4) -> list[str]:
    if test is None or test.interval is None:
        deltas = "" if test is None else ", ".join(f"{d:+.{digits}f}" for d in test.deltas)
        return [deltas, "", "", "", "", "one seed: no test" if test else ""]
    mean, low, high = test.interval
    return [
        ", ".join(f"{d:+.{digits}f}" for d in test.deltas),
        f"**{mean:+.{digits}f}**, {low:+.{digits}f} to {high:+.{digits}f}",
        "< 0.001" if test.p_adjusted < 0.001 else f"{test.p_adjusted:.3f}",
        "" if test.detectable is None else f"±{test.detectable:.{digits}f}",
        "" if test.tost is None else f"{test.tost:.3f}",
        test.verdict,
    ]


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def quality_section(designs, keys: list[str], margin: float, what: str, digits: int = 4) -> str:
    """Per figure: each design's mean ± sd over seeds, and its test against MHA."""
    parts = []
    for key in keys:
        tests = tests_against_mha(designs, key, margin)
        rows = []
        for design, seeds in designs.items():
            values = [number(r.get(key)) for r in seeds.values() if r.get(key) is not None]
            if not values:
                continue
            cells = ["" for _ in range(6)] if design == "mha" else _test_cells(tests.get(design))
            if design == "mha":
                cells[-1] = "(the reference)"
            rows.append([design, str(len(values)), _mean_sd(values), *cells])
        headers = [
            "design", "seeds", f"{what} (mean ± sd)", "Δ vs MHA per seed",
            "mean Δ, 95% t-interval", "p, Holm", "detectable", f"TOST ±{margin:g}", "verdict",
        ]  # fmt: skip
        parts.append(f"**{key}**\n\n" + _table(headers, rows))
    return "\n\n".join(parts)


def speed_section(rows: list[dict[str, Any]]) -> str:
    headers = [
        "design", "context x batch", "ms/token, median (min-max of rounds)",
        "speed x MHA, median (min-max)", "cache MiB held", "rounds",
    ]  # fmt: skip
    lines = []
    for r in sorted(
        rows, key=lambda r: (r["context"], r["batch"], DESIGN_ORDER.get(r["design"], 9))
    ):
        if r.get("ms") is None:
            lines.append(
                [r["design"], f"{r['context']} x {r['batch']}", r.get("note", ""), "", "", ""]
            )
            continue
        lines.append([
            r["design"], f"{r['context']:,} x {r['batch']}",
            f"{r['ms']:.2f} ({r['ms_min']:.2f}-{r['ms_max']:.2f})",
            f"{r['x_mha']:.2f} ({r['x_mha_min']:.2f}-{r['x_mha_max']:.2f})",
            f"{r['cache_bytes'] / 2**20:,.1f}", str(len(r.get("round_ms") or [])),
        ])  # fmt: skip
    return _table(headers, lines)


def context_use_section(designs, first: str, last: str) -> str:
    """How much each design's loss falls from the first position bucket to the last: what
    distant context is worth to it (per seed, and their mean)."""
    rows = []
    for design, seeds in designs.items():
        gains = [
            100 * (1 - number(r.get(last)) / number(r.get(first)))
            for r in seeds.values()
            if r.get(first) is not None and r.get(last) is not None
        ]
        if gains:
            per_seed = ", ".join(f"{g:+.2f}%" for g in gains)
            rows.append([design, per_seed, f"{statistics.fmean(gains):+.2f}%"])
    what = f"Context use: the loss at {last.split('@')[1]} below the loss at {first.split('@')[1]}"
    return f"**{what}**\n\n" + _table(["design", "per seed", "mean"], rows)


def runs_section(designs) -> str:
    rows = []
    for design, seeds in designs.items():
        run = next(iter(seeds.values()))
        rows.append([
            design, str(run.get("run_name")), ", ".join(str(s) for s in seeds),
            f"{number(run.get('params/total')):,.0f}",
            f"{number(run.get('params/attention')):,.0f}",
            f"{number(run.get('kv_cache/bytes_per_token')):,.0f}", str(run.get("steps")),
        ])  # fmt: skip
    headers = [
        "design", "run name", "seeds", "parameters", "attention parameters",
        "KV-cache bytes/token (fp32)", "steps",
    ]  # fmt: skip
    return _table(headers, rows)


def pareto_setting(speed_rows: list[dict]) -> tuple[int, int] | None:
    """The benchmarked ``(context, batch)`` with the most cached tokens per step (context x
    batch, then the longer context): where the cache weighs most in a step."""
    return max(
        ((r["context"], r["batch"]) for r in speed_rows if r.get("ms")),
        key=lambda setting: (setting[0] * setting[1], setting[0]),
        default=None,
    )


def plot_pareto(lm: dict, speed_rows: list[dict], key: str, path: Path) -> None:
    """Held-out loss ``key`` (mean over seeds, min-max bars) against KV-cache bytes per token
    and against decoding tokens/s at :func:`pareto_setting`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    largest = pareto_setting(speed_rows)
    speed = {r["design"]: r for r in speed_rows if (r["context"], r["batch"]) == largest}
    for i, (design, seeds) in enumerate(lm.items()):
        values = [number(r.get(key)) for r in seeds.values() if r.get(key) is not None]
        if not values:
            continue
        y = statistics.fmean(values)
        yerr = [[y - min(values)], [max(values) - y]]
        cache = number(next(iter(seeds.values())).get("kv_cache/bytes_per_token"))
        axes[0].errorbar([cache], [y], yerr=yerr, fmt="o", color=f"C{i}", capsize=3, label=design)
        if design in speed:
            r = speed[design]
            x = r["batch"] * 1000 / r["ms"]
            xerr = [[x - r["batch"] * 1000 / r["ms_max"]], [r["batch"] * 1000 / r["ms_min"] - x]]
            axes[1].errorbar([x], [y], xerr=xerr, yerr=yerr, fmt="o", color=f"C{i}", capsize=3,
                             label=design)  # fmt: skip
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("KV-cache bytes per token (fp32, all layers)")
    setting = f"{largest[0]:,} x {largest[1]}" if largest else "no benchmark rows"
    axes[1].set_xlabel(f"decoding tokens/s at context x batch {setting} (min-max of rounds)")
    for ax in axes:
        ax.set_ylabel(f"held-out {key} (nats)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("points: mean over seeds; bars: min-max over seeds (loss), of rounds (speed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_lm_comparison(
    runs: list[RunResult],
    out: str | Path,
    speed_rows: list[dict[str, Any]] | None,
    pool_despite: Sequence[str] = (),
) -> list[Path]:
    """The comparison of the LM and MQAR runs in ``runs``, written into ``out``;
    ``pool_despite`` as in :func:`check_seed_configs`."""
    despite = set()
    for kind in ("lm", "mqar"):  # a run name pools seeds of one configuration only
        despite |= set(check_seed_configs([r for r in runs if task(r) == kind], pool_despite))
    refuse_unused_pool_despite(pool_despite, despite)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lm = by_design([r for r in runs if task(r) == "lm"])
    mqar = by_design([r for r in runs if task(r) == "mqar"])
    parts = ["# What each design costs and buys at long context\n"]
    if despite:
        parts += [pooled_despite_note(sorted(despite)).strip(), ""]
    csv_rows = []
    if lm:
        every = [r for seeds in lm.values() for r in seeds.values()]
        keys = ["val/loss", *figures(every, "val/loss@")]
        parts += ["## The language model\n", runs_section(lm), ""]
        parts += [context_use_section(lm, keys[1], keys[-1]), ""]
        parts += [quality_section(lm, keys, LOSS_MARGIN, "held-out loss, nats"), ""]
        csv_rows += [
            {"task": "lm", "design": d, "seed": s, **{k: r.get(k) for k in keys + ["val/ppl"]}}
            for d, seeds in lm.items()
            for s, r in seeds.items()
        ]
    if mqar:
        every = [r for seeds in mqar.values() for r in seeds.values()]
        keys = figures(every, "val/acc@")
        parts += ["## MQAR\n", runs_section(mqar), ""]
        parts += [quality_section(mqar, keys, ACC_MARGIN, "accuracy", digits=3), ""]
        csv_rows += [
            {"task": "mqar", "design": d, "seed": s, **{k: r.get(k) for k in keys}}
            for d, seeds in mqar.items()
            for s, r in seeds.items()
        ]
    if speed_rows:
        parts += ["## Decoding the trained checkpoints\n", speed_section(speed_rows), ""]
    paths = [out / "long_context.md", out / "long_context.csv"]
    paths[0].write_text("\n".join(parts) + "\n")
    fields = list(dict.fromkeys(k for row in csv_rows for k in row))
    with paths[1].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(csv_rows)
    if lm:
        every = [r for seeds in lm.values() for r in seeds.values()]
        last = figures(every, "val/loss@")[-1]
        paths.append(out / "long_context_pareto.png")
        plot_pareto(lm, speed_rows or [], last, paths[-1])
    return paths


def read_speed_rows(path: str | Path | None) -> list[dict[str, Any]] | None:
    """The rows ``benchmark_long_context.py --checkpoints ... --json`` wrote, or ``None``."""
    if path is None:
        return None
    rows = json.loads(Path(path).read_text())
    if not isinstance(rows, list) or any(r.get("candidate") != "trained" for r in rows):
        raise ValueError(
            f"long_context={path}: expected the rows of benchmark_long_context.py "
            "--checkpoints (candidate 'trained')"
        )
    return rows
