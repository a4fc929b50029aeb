"""The comparison's words and tables, worked out once: which runs, which BLEU, the tests
against MHA over seeds, whether the runs' own speeds mean anything, and the Pareto
frontiers; written as ``comparison.md`` and ``comparison.csv``.

Speeds measured while a run trained mean something only if no other run shared its machine
then: :func:`training_overlap` tells from the runs' records (``run/start``, ``run/end`` and
the machine, ``run/boot_id``, else ``run/host``). What it cannot see is any other work on
the same cores: jobs outside this project, or runs that did not record themselves. Speeds
measured side by side (``compare.py speed=true``, kept in each run's ``speed.json``) are
read in place of them where every run has one.
"""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from multihead.analysis.against_mha import (
    CORRECTION,
    SeedTest,
    contrasts,
    seed_tests,
    verdict,
)
from multihead.analysis.runs import (
    HYP_BLEU,
    SPEED_FILE,
    RunResult,
    beam_key,
    has_repeats,
    mha_baseline,
    number,
    seed_groups,
    seed_means,
    value,
)
from multihead.analysis.significance import ALPHA, POWER
from multihead.analysis.speed import BEAM_KEY, GREEDY_KEY, TRAIN_KEY

MISSING = "–"


def significance_markdown(runs: list[RunResult]) -> str:
    """The per-run table of paired tests against MHA, each seed on its own."""
    headers = ["run", "MHA run", "seed", "BLEU", "MHA BLEU", "Δ", "95% interval", "p"]
    headers.append("verdict (this seed alone, unadjusted)")
    rows = []
    for run in runs:
        if (r := run.paired) is None:
            continue
        rows.append(
            [
                run.label,
                run.baseline.label,
                str(run.seed),
                f"{r.score:.2f}",
                f"{r.baseline:.2f}",
                f"{r.delta:+.2f}",
                f"[{r.low:+.2f}, {r.high:+.2f}]",
                f"{r.p_value:.4f}",
                verdict(r.low, r.high, r.p_value),
            ]
        )
    return markdown_table(headers, rows) if rows else ""


# ---------------------------------------------------------------------------------------
# Speeds: measured during training, or side by side


def utc_time(stamp: str) -> datetime:
    """An ISO 8601 timestamp as an aware time; one without an offset is taken as UTC, as
    training writes them (``multihead.host.utc_now``)."""
    moment = datetime.fromisoformat(stamp)
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def machine(run: RunResult) -> tuple[str, Any]:
    """What says which machine a run trained on: its kernel's boot id where it recorded
    one (``run/boot_id``), else its host name (``run/host``, ``vm`` on many clones)."""
    if run.get("run/boot_id"):
        return "boot id", run.get("run/boot_id")
    return "host", run.get("run/host")


OVERLAP_BLIND = (
    "Overlap is told from the runs' own records only: other work on the same cores (jobs "
    "outside this project, runs that recorded nothing) slows a run unseen."
)


def training_overlap(runs: list[RunResult]) -> tuple[str, str]:
    """``(status, sentence)``: whether runs trained at the same time on one machine
    (:func:`machine`).

    ``status`` is ``overlap``, ``no overlap`` or ``unknown`` (some run's summary lacks
    ``run/start``, ``run/end`` or ``run/host``: runs from before summaries recorded them).
    """
    keys = ("run/start", "run/end", "run/host")
    lacking = [run.label for run in runs if any(not run.get(k) for k in keys)]
    if lacking:
        return "unknown", (
            f"Overlap unknown: {len(lacking)} of {len(runs)} runs do not record when and where "
            "they trained (run/start, run/end, run/host in summary.json), so their "
            "speeds measured during training may come from runs sharing the machine."
        )
    spans = [(run, utc_time(run.get("run/start")), utc_time(run.get("run/end"))) for run in runs]
    pairs = [
        (a.label, b.label)
        for i, (a, a0, a1) in enumerate(spans)
        for b, b0, b1 in spans[i + 1 :]
        if machine(a) == machine(b) and a0 < b1 and b0 < a1
    ]
    by_name = sum(machine(run)[0] == "host" for run in runs)
    if by_name == len(runs):
        told = (
            " Machines are told apart by host name only, which clones share (`vm` on many): "
            "these runs recorded no kernel boot id."
        )
    elif by_name:
        told = (
            f" Machines are told apart by the kernel's boot id; {by_name} of {len(runs)} runs "
            "recorded none, and for them by host name, which clones share."
        )
    else:
        told = " Machines are told apart by the kernel's boot id."
    if pairs:
        shown = "; ".join(f"{a} and {b}" for a, b in pairs[:5])
        more = f" and {len(pairs) - 5} more pairs" if len(pairs) > 5 else ""
        return "overlap", (
            f"**Runs overlapped in time on one machine** ({shown}{more}): their speeds measured "
            f"during training slowed each other and are not comparable.{told} {OVERLAP_BLIND}"
        )
    return "no overlap", (
        f"No two runs trained at the same time on one machine.{told} {OVERLAP_BLIND}"
    )


def speed_columns(runs: list[RunResult]) -> tuple[tuple[str, str, str], ...]:
    """The speed columns: the runs' own (measured during training), and the side-by-side
    measurement's when ``speed=true`` made one."""
    own = (
        ("train tgt tok/s (in training)", "perf/train_tgt_tokens_per_s", ",.0f"),
        ("greedy sent/s (in training)", "decode/greedy_sentences_per_s", ",.1f"),
        ("beam sent/s (in training)", "beam", ",.1f"),
    )
    if not any(run.get(GREEDY_KEY) is not None for run in runs):
        return own
    return own + (
        ("train tgt tok/s (side by side)", TRAIN_KEY, ",.0f"),
        ("greedy sent/s (side by side)", GREEDY_KEY, ",.1f"),
        ("beam sent/s (side by side)", BEAM_KEY, ",.1f"),
    )


def side_by_side(runs: list[RunResult]) -> tuple[dict[str, Any] | None, str]:
    """``(setup, note)`` of the side-by-side speeds the runs' records hold.

    Speeds are comparable only within one measurement: the setup most runs share is kept,
    and the speeds of runs measured otherwise are dropped from their figures. ``setup`` is
    ``None`` (no side-by-side speeds reported) unless every configuration has a run in it;
    ``note`` names the runs left out and says why.
    """
    setups = [run.speed_setup for run in runs if run.speed_setup is not None]
    if not setups:
        return None, ""
    setup = max(setups, key=setups.count)
    outside = [run for run in runs if run.speed_setup != setup]
    for run in outside:
        for key in (TRAIN_KEY, GREEDY_KEY, BEAM_KEY):
            run.summary.pop(key, None)
        run.speed_setup = None
    if not outside:
        return setup, ""
    names = ", ".join(run.label for run in outside[:6])
    more = f" and {len(outside) - 6} more" if len(outside) > 6 else ""
    why = (
        f"{len(outside)} of {len(runs)} runs ({names}{more}) have no {SPEED_FILE} from that "
        "measurement (measured apart or not at all), so their side-by-side speeds are blank"
    )
    unmeasured = [
        name for name, group in seed_groups(runs).items() if all(r in outside for r in group)
    ]
    if unmeasured:
        return None, (
            f"**Side-by-side speeds left out:** {why}, and {', '.join(unmeasured)} has no "
            "measured run at all. Measure every run again together with `compare.py speed=true`."
        )
    return setup, (
        f"{why}; the means over seeds take the speeds of the measured runs. Measure every "
        "run together with `compare.py speed=true` to fill them in."
    )


def reported_speeds(runs: list[RunResult], overlap: str, setup) -> dict[str, str] | None:
    """The speed keys the ratios and plots use: the side-by-side ones when measured (a
    ``setup``), the runs' own when no runs overlapped, else ``None`` (no speed is worth
    plotting)."""
    if setup is not None:
        return {"train": TRAIN_KEY, "greedy": GREEDY_KEY, "beam": BEAM_KEY, "as": "side by side"}
    if overlap == "no overlap":
        return {
            "train": "perf/train_tgt_tokens_per_s",
            "greedy": "decode/greedy_sentences_per_s",
            "beam": "beam",
            "as": "in training",
        }
    return None


# ---------------------------------------------------------------------------------------
# The table


# The table's columns: (header, summary key, format). The key ``beam`` means the
# decode/beam<k>_sentences_per_s key, whatever k is. The speeds follow (speed_columns).
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
    ("peak MB", "perf/peak_memory_mb", ",.0f"),
    ("val BLEU", "val/bleu", ".2f"),
    ("test BLEU", "test/bleu", ".2f"),
)


def columns(report: Report) -> tuple[tuple[str, str, str], ...]:
    """COLUMNS, the speed columns, and the hypotheses' BLEU when the tests computed it."""
    runs = report.runs
    extra = ((f"test BLEU {report.metric} (hypotheses)", HYP_BLEU, ".2f"),)
    return COLUMNS + speed_columns(runs) + (extra if any(r.get(HYP_BLEU) for r in runs) else ())


def ratios(report: Report) -> tuple[tuple[str, str, str], ...]:
    """The ratios against MHA: (header, key, kind). Speeds only where they mean something."""
    found = [("KV-cache ×", "kv_cache/bytes_per_token", "ratio")]
    found.append(("attention params ×", "params/attention", "ratio"))
    if (speeds := report.speeds) is not None:
        found += [
            (f"train tok/s × ({speeds['as']})", speeds["train"], "ratio"),
            (f"greedy × ({speeds['as']})", speeds["greedy"], "ratio"),
            (f"beam × ({speeds['as']})", speeds["beam"], "ratio"),
        ]
    found.append((f"{report.bleu_name} Δ", report.bleu_key, "diff"))
    return tuple(found)


def ratio_row(run: RunResult, base: RunResult, spec) -> dict[str, float | None]:
    row = {}
    for header, key, kind in spec:
        mine, theirs = number(value(run, key)), number(value(base, key))
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
    figure = number(raw)
    if figure is None:
        return str(raw)
    if fmt.endswith("d"):
        figure = round(figure)
    return format(figure, fmt)


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass
class Report:
    """What the comparison's files say, worked out once: the runs, where they came from,
    which BLEU the headline figures use, the tests, the overlap and the speeds."""

    runs: list[RunResult]
    source: str
    significance: str = ""  # how the tests were made, or why there are none
    metric: str = ""  # the BLEU of the hypotheses (the tests' metric)
    margin: float | None = None  # the equivalence margin, in BLEU, set in advance
    overlap: tuple[str, str] = ("unknown", "")
    speed_setup: dict[str, Any] | None = None  # the side-by-side measurement's setup
    speed_gaps: str = ""  # which runs lack side-by-side speeds, and what was done
    bleu_key: str = "test/bleu"
    tests: dict[str, SeedTest] = field(default_factory=dict)  # by configuration
    # scripts/benchmark_long_context.py's rows (its --json), for "what each design buys"
    long_context: list[dict[str, Any]] | None = None
    contrasts: dict[tuple[str, str], SeedTest] = field(default_factory=dict)

    @property
    def bleu_name(self) -> str:
        return f"test BLEU {self.metric} (hypotheses)" if self.bleu_key == HYP_BLEU else "test BLEU"

    @property
    def speeds(self) -> dict[str, str] | None:
        return reported_speeds(self.runs, self.overlap[0], self.speed_setup)

    @property
    def points(self) -> list[RunResult]:
        """What the plots and frontiers show: seed means when configurations repeat."""
        return seed_means(self.runs) if has_repeats(self.runs) else self.runs


def make_report(
    runs: list[RunResult], source: str, significance: str, metric: str, margin: float | None
) -> Report:
    """Work out the report: the BLEU, the overlap, the side-by-side speeds (dropping
    those outside the one measurement) and the tests over seeds."""
    setup, gaps = side_by_side(runs)
    report = Report(runs, source, significance, metric, margin, training_overlap(runs), setup, gaps)
    if runs and all(run.get(HYP_BLEU) is not None for run in runs):
        report.bleu_key = HYP_BLEU
    if has_repeats(runs):
        report.tests = seed_tests(runs, report.bleu_key, margin)
        report.contrasts = contrasts(runs, report.bleu_key, margin)
    return report


def p_cell(p: float | None) -> str:
    return MISSING if p is None else f"{p:.3f}"


def seed_test_cells(test: SeedTest | None) -> list[str]:
    """Mean Δ, t-interval, per-seed Δ, p, Holm's p, detectable, TOST p, verdict."""
    if test is None:
        return [MISSING] * 8
    interval = test.interval
    return [
        format_cell(statistics.fmean(test.deltas), "+.2f"),
        MISSING if interval is None else f"[{interval[1]:+.2f}, {interval[2]:+.2f}]",
        ", ".join(f"{d:+.2f}" for d in test.deltas),
        p_cell(test.p_value),
        p_cell(test.p_adjusted),
        MISSING if test.detectable is None else f"±{test.detectable:.2f}",
        p_cell(test.tost),
        test.verdict,
    ]


TEST_HEADERS = [
    "95% t-interval",
    "Δ per seed",
    "p (paired t)",
    f"p ({CORRECTION})",
    "detectable (80% power, unadjusted α 0.05)",
    "TOST p",
    "verdict",
]


def how_tested(report: Report, family: str) -> str:
    """The paragraph under a seed table: which test, which correction, what else stands."""
    margin = (
        f"TOST p is the two one-sided t-tests that the true difference lies within "
        f"±{report.margin:g} BLEU (`equivalence_margin`, set before the runs): "
        "**equivalent** only where it is below 0.05"
        if report.margin is not None
        else "no equivalence test (`equivalence_margin: null`), so no design is called equal"
    )
    return (
        f"p (paired t) is the two-sided t-test of the per-seed differences, unadjusted; "
        f"p ({CORRECTION}) is {CORRECTION}'s step-down adjustment over the {family}, which "
        f"the verdict takes: **lower** or **higher** where it is below {ALPHA}, else **no "
        f"detectable difference**. Detectable is the true difference this test finds with "
        f"{POWER:.0%} power (two-sided, α {ALPHA}) at this number of seeds, given the per-"
        f"seed differences' standard deviation: smaller ones go unseen. {margin}."
    )


def seed_means_markdown(report: Report) -> str:
    """The headline section of ``comparison.md``: each configuration over its seeds, its
    paired Δ against MHA with its tests over seeds, and its verdict; then the contrasts
    between designs of one cache size."""
    runs, key, speeds = report.runs, report.bleu_key, report.speeds
    headers = [
        "configuration",
        "runs",
        report.bleu_name,
        "min–max",
        "Δ vs MHA, paired (mean)",
        *TEST_HEADERS,
        "KV-cache bytes/token",
        "params",
    ]
    if speeds is not None:
        headers.append(f"train tgt tok/s ({speeds['as']})")
        headers += [f"{h} sent/s ({speeds['as']})" for h in ("greedy", "beam")]
    rows = []
    for (name, group), mean in zip(seed_groups(runs).items(), seed_means(runs), strict=True):
        low, high = mean.get(f"{key}_min"), mean.get(f"{key}_max")
        row = [
            name,
            str(len(group)),
            format_cell(mean.get(key), ".2f"),
            MISSING if low is None else f"{low:.2f}–{high:.2f}",
            *seed_test_cells(report.tests.get(name)),
            format_cell(mean.get("kv_cache/bytes_per_token"), ",d"),
            format_cell(mean.get("params/total"), ",d"),
        ]
        if speeds is not None:
            row.append(format_cell(value(mean, speeds["train"]), ",.0f"))
            row += [format_cell(value(mean, speeds[k]), ",.1f") for k in ("greedy", "beam")]
        rows.append(row)
    parts = [
        "\n## Means over seeds\n",
        "Runs that share a run name are one configuration run with different seeds. "
        f"Δ is paired: each run's {report.bleu_name} minus that of the MHA run with the "
        "same seed and number of heads; the 95% interval of their mean is Student's t "
        f"over the seeds (none with one seed). {how_tested(report, 'designs tested against MHA')}"
        " The plots and the frontiers use these means.\n",
        markdown_table(headers, rows),
    ]
    if report.contrasts:
        contrast_rows = [
            [a, b, *seed_test_cells(test)] for (a, b), test in report.contrasts.items()
        ]
        parts += [
            "\n## Designs of one KV-cache size against each other\n",
            "Each pair of designs that store the same KV-cache bytes per token, by the same "
            f"test: Δ is the first's {report.bleu_name} minus the second's, paired by seed. "
            f"{how_tested(report, 'contrasts in this table')}\n",
            markdown_table(["design", "against", "Δ (mean)", *TEST_HEADERS], contrast_rows),
        ]
    return "\n".join(parts)


def seed_rows(report: Report) -> tuple[list[str], list[list[Any]]]:
    """The configurations over seeds and the contrasts, unformatted: the rows of the wandb
    table ``seed_means``."""
    fields = [
        "configuration",
        "against",
        "runs",
        report.bleu_name,
        "Δ (mean)",
        "Δ low",
        "Δ high",
        "p (paired t)",
        f"p ({CORRECTION})",
        "detectable (80% power, unadjusted α 0.05)",
        "TOST p",
        "verdict",
    ]
    groups = seed_groups(report.runs)
    means = dict(zip(groups, seed_means(report.runs), strict=True))
    named = [(name, "MHA", test) for name, test in report.tests.items()]
    named += [(a, b, test) for (a, b), test in report.contrasts.items()]
    rows = []
    for name, against, test in named:
        mean, low, high = test.interval or (statistics.fmean(test.deltas), None, None)
        rows.append(
            [
                name,
                against,
                len(groups[name]),
                number(means[name].get(report.bleu_key)),
                mean,
                low,
                high,
                test.p_value,
                test.p_adjusted,
                test.detectable,
                test.tost,
                test.verdict,
            ]
        )
    return fields, rows


def comparison_markdown(report: Report) -> str:
    """The text of ``comparison.md``: notes on speeds, the runs table, ratios vs MHA, the
    tests, the seed means, plots and sources."""
    runs = report.runs
    cols = columns(report)
    headers = ["run"] + [h for h, _, _ in cols]
    rows = [[run.label] + [format_cell(value(run, k), f) for _, k, f in cols] for run in runs]
    parts = [f"# Run comparison\n\n{len(runs)} runs from `{report.source}`.\n", speed_note(report)]
    parts.append(markdown_table(headers, rows))

    beams = sorted({k for run in runs if (k := beam_key(run.summary))})
    if beams:
        parts.append(f"\nbeam sent/s (in training): `{'`, `'.join(beams)}`.")

    spec = ratios(report)
    ratio_lines = []
    for run in runs:
        base = mha_baseline(run, runs)
        if base is None:
            continue
        found = ratio_row(run, base, spec)
        ratio_lines.append(
            [run.label, base.label]
            + [format_cell(found[h], "+.2f" if kind == "diff" else ".2f") for h, _, kind in spec]
        )
    if ratio_lines:
        parts.append("\n## Against MHA with the same number of heads\n")
        parts.append(
            "× is this run's figure divided by the MHA run's (KV-cache below 1 is smaller, "
            "speed above 1 is faster); Δ is the difference in BLEU points.\n"
        )
        parts.append(markdown_table(["run", "MHA run"] + [h for h, _, _ in spec], ratio_lines))

    parts.append(f"\n## Significance against MHA of the same seed\n\n{report.significance}\n")
    if table := significance_markdown(runs):
        parts.append(table)
    if has_repeats(runs):
        parts.append(seed_means_markdown(report))
    parts.append(_frontier_lines(report))
    if report.long_context is not None:
        parts.append(long_context_markdown(report))
    parts.append(
        "\n## Plots\n\n![test BLEU vs decoding speed](bleu_vs_decode_speed.png)\n\n"
        "![test BLEU vs KV-cache bytes per token](bleu_vs_kv_cache.png)\n\n"
        "![Δ BLEU against MHA with 95% intervals](delta_vs_mha.png)\n\n"
        "![validation curves](validation_curves.png)\n\n## Sources\n"
    )
    for run in runs:
        parts.append(f"- {run.label}: `{run.source}` (validation curves: {run.curve_source})")
    return "\n".join(parts) + "\n"


def speed_note(report: Report) -> str:
    """Above the table: where each speed column comes from and whether it means anything."""
    lines = [
        "Speeds marked *in training* are the runs' own, measured while each run trained. "
        + report.overlap[1]
    ]
    setup = report.speed_setup
    if setup is not None:
        lines.append(
            f"Speeds marked *side by side* were measured by `compare.py speed=true` (kept in "
            f"each run's `{SPEED_FILE}`) in one process, the runs interleaved "
            f"({setup['rounds']} rounds, medians): on "
            f"{setup['cpu']} ({setup['host']}), {setup['threads']} threads, torch "
            f"{setup['torch']}; decoding {setup['test_sentences']} test sentences with each "
            f"run's checkpoint (greedy and beam {setup['beam_size']}, batches of "
            f"{setup['batch_size']}), training fp32 steps over {setup['train_sentences']} "
            f"training sentences in batches of <= {setup['max_tokens']} tokens."
        )
    if report.speed_gaps:
        lines.append(report.speed_gaps)
    speeds = report.speeds
    if speeds is None:
        lines.append(
            "The plots and ratios leave the in-training speeds out; measure them side by "
            "side with `compare.py speed=true`."
        )
    else:
        lines.append(f"The plots and ratios use the speeds measured {speeds['as']}.")
    return "\n\n".join(lines) + "\n"


def long_context_markdown(report: Report) -> str:
    """What each compared kind of design buys where it pays: the long-context benchmark's
    decoding speed for that kind (the project's path, ``ours-static``) as a multiple of
    MHA's at each context and batch, beside the cache its own design and these runs hold
    as a fraction of MHA's (the benchmark measures one design per kind on its own shape)."""
    rows = [
        r for r in report.long_context or [] if r.get("candidate") == "ours-static" and r.get("ms")
    ]
    dtypes = sorted({r["dtype"] for r in rows})
    settings = sorted({(r["context"], r["batch"]) for r in rows})
    measured = {(r["design"], r["dtype"], r["context"], r["batch"]): r for r in rows}
    configurations: dict[str, dict[str, float | None]] = {}  # kind -> run name -> cache x MHA
    for run in report.runs:
        kind, base = value(run, "kind"), mha_baseline(run, report.runs)
        mine = number(value(run, "kv_cache/bytes_per_token"))
        theirs = None if base is None else number(value(base, "kv_cache/bytes_per_token"))
        ratio = 1.0 if kind == "mha" else (mine / theirs if mine and theirs else None)
        name = str(value(run, "run_name") or run.label)
        configurations.setdefault(str(kind), {})[name] = ratio
    headers = ["kind", "these runs: cache × MHA", "benchmark: cache × MHA"]
    cells = [(d, c, b) for d in dtypes for c, b in settings]
    headers += [f"{d} {c // 1024}k × {b}: speed × MHA" for d, c, b in cells]
    table = []
    for kind, names in sorted(configurations.items()):
        here = ", ".join(f"{n} ({format_cell(x, '.3g')})" for n, x in names.items())
        pairs = [(measured.get((kind, *cell)), measured.get(("mha", *cell))) for cell in cells]
        caches = [m["cache_bytes"] / h["cache_bytes"] for m, h in pairs if m and h]
        speeds = [h["ms"] / m["ms"] if m and h else None for m, h in pairs]
        row = [kind, here, format_cell(caches[0] if caches else None, ".3g")]
        table.append(row + [format_cell(x, ".2f") for x in speeds])
    return "\n".join(
        [
            "\n## What each design buys: decoding at long context\n",
            "Tokens per second of one decoding step at each context × batch, as a multiple "
            "of MHA's (above 1 is faster), measured by `scripts/benchmark_long_context.py` "
            "on its own reference shape (one design per kind: GQA there has a quarter of the "
            "heads' K/V, MLA an eighth of MHA's cache), the project's path on HF's "
            "StaticCache; kinds it does not measure are blank. The BLEU above is what a "
            "design costs; this is what it is for.\n",
            markdown_table(headers, table),
        ]
    )


def _frontier_lines(report: Report) -> str:
    """The Pareto frontiers of test BLEU against KV-cache bytes and decoding speed."""
    lines = [f"\n## Pareto frontiers ({report.bleu_name} against ...)\n"]
    axes = [("kv_cache/bytes_per_token", "KV-cache bytes per token (fewer is better)")]
    if (speeds := report.speeds) is not None:
        axes.append((speeds["greedy"], f"greedy sentences/s, {speeds['as']} (more is better)"))
    for key, what in axes:
        frontier = pareto_frontier(
            report.points,
            key,
            lower_is_better=LOWER_IS_BETTER.get(key, False),
            bleu_key=report.bleu_key,
        )
        names = ", ".join(run.label for run in frontier) or "no runs with both figures"
        lines.append(f"- {what}: {names}")
    return "\n".join(lines) + "\n"


def table_rows(report: Report) -> tuple[list[str], list[list[Any]]]:
    """Every column, unformatted, the ratios vs MHA, the paired test and each run's source:
    the rows of ``comparison.csv`` and of the wandb table."""
    runs = report.runs
    cols, spec = columns(report), ratios(report)
    tests = ["paired Δ", "Δ low", "Δ high", "p", "verdict (this seed, unadjusted)", "MHA run"]
    fields = ["run", *[h for h, _, _ in cols], *[h for h, _, _ in spec], *tests, "source"]
    rows = []
    for run in runs:
        row = [value(run, k) for _, k, _ in cols]
        base = mha_baseline(run, runs)
        found = ratio_row(run, base, spec) if base is not None else {}
        row += [found.get(h) for h, _, _ in spec]
        r = run.paired
        if r is None:
            row += [None] * len(tests)
        else:
            row += [r.delta, r.low, r.high, r.p_value, verdict(r.low, r.high, r.p_value)]
            row.append(run.baseline.label)
        rows.append([run.label, *row, run.source])
    return fields, rows


def write_csv(report: Report, path: Path) -> None:
    fields, rows = table_rows(report)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(fields)
        writer.writerows([["" if v is None else v for v in row] for row in rows])


# ---------------------------------------------------------------------------------------
# Plots


def pareto_frontier(
    runs: list[RunResult], key: str, *, lower_is_better: bool, bleu_key: str = "test/bleu"
) -> list[RunResult]:
    """The runs no other run beats on both test BLEU and ``key``, in ``key`` order (best
    first): a run is on the frontier when every run at least as good on ``key`` scores a
    lower BLEU."""
    points = [
        (x, y, run)
        for run in runs
        if (x := number(value(run, key))) is not None
        and (y := number(value(run, bleu_key))) is not None
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
