"""The comparison's last stage, reported: the words and tables, worked out once from what
the stages before found (the runs, their grouping and grids, their equal terms, the tests):
for translation ``comparison.md`` and ``comparison.csv`` (whether the runs' own speeds mean
anything, the Pareto frontiers), for the LM and MQAR ``long_context.md`` and
``long_context.csv``; the sections every comparison has (equal terms, the learning-rate
grid, the learning curves, the declared family) are written once for both.

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

from multihead.analysis.describe import Description
from multihead.analysis.groups import (
    Grid,
    Grouped,
    design_of,
    display_names,
    has_repeats,
    is_mha,
    learning_rate,
    mha_baseline,
    pooled_despite_note,
    seed_groups,
    seed_means,
)
from multihead.analysis.runs import (
    HYP_BLEU,
    SPEED_FILE,
    RunResult,
    beam_key,
    number,
    value,
)
from multihead.analysis.significance import ALPHA, POWER
from multihead.analysis.speed import BEAM_KEY, GREEDY_KEY, TRAIN_KEY
from multihead.analysis.tested import (
    CORRECTION,
    Family,
    SeedTest,
    evaluations,
    is_mha_design,
    verdict,
)

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
    # every test over seeds, by (task, design, baseline, figure): against MHA, and contrasts
    keyed: dict[tuple[str, str, str, str], SeedTest] = field(default_factory=dict)
    # scripts/benchmark_long_context.py's rows (its --json), for "what each design buys"
    long_context: list[dict[str, Any]] | None = None
    grouped: Grouped | None = None
    described: dict[str, Description] = field(default_factory=dict)  # by design
    family: Family | None = None

    @property
    def tests(self) -> dict[str, SeedTest]:
        """Each configuration's test against MHA, by configuration."""
        return {d: t for (_, d, b, _k), t in self.keyed.items() if self._is_mha_name(b)}

    @property
    def contrasts(self) -> dict[tuple[str, str], SeedTest]:
        """Designs of one cache size against each other."""
        return {(d, b): t for (_, d, b, _k), t in self.keyed.items() if not self._is_mha_name(b)}

    def _is_mha_name(self, name: str) -> bool:
        groups = seed_groups(self.runs)
        return name == "MHA" or (name in groups and is_mha(groups[name][0]))

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
    runs: list[RunResult], source: str, significance: str, metric: str, margin: float | None,
    bleu_key: str = "test/bleu",
) -> Report:  # fmt: skip
    """Work out the report: the overlap and the side-by-side speeds (dropping those outside
    the one measurement); the tests come from the stage before."""
    setup, gaps = side_by_side(runs)
    report = Report(runs, source, significance, metric, margin, training_overlap(runs), setup, gaps)
    report.bleu_key = bleu_key
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
    if report.family is not None:
        family = family_words(report.family)
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
    if report.described:
        parts.append(equal_terms_section(report.described))
    if report.grouped is not None:
        parts.append(grid_section(report.grouped.grids))
    keys = [k for k in ("val/bleu", "val/loss") if any(k in run.curves for run in runs)]
    if keys:
        designs = {name: dict(enumerate(group)) for name, group in seed_groups(runs).items()}
        parts.append(curves_section(designs, keys, figure="validation_curves.png"))
    if has_repeats(runs):
        parts.append(family_section(report.keyed, report.family, runs))
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


# ---------------------------------------------------------------------------------------
# Every comparison's sections: equal terms, the grid, the learning curves, the family


def family_words(family: Family) -> str:
    return (
        f"whole family of {len(family.confirmatory)} tests declared in `{family.path}` "
        f"({family.declared.isoformat()}, commit {family.commit}; declared tests without runs "
        "count as p = 1)"
    )


def equal_terms_rows(
    described: dict[str, Description], names: dict[str, str] | None = None
) -> tuple[list[str], list[list[Any]]]:
    """What else differs between the designs, unformatted: the rows of the equal-terms
    table and of its wandb table."""
    contexts = {d.context for d in described.values()}
    at = f" at {contexts.pop():,}" if len(contexts) == 1 else ""
    fields = [
        "design", "parameters", "attention parameters", f"multiply-adds per token{at}",
        "score width per head (rotary features)", "KV-cache bytes/token (fp32)", "note",
    ]  # fmt: skip
    rows = [
        [(names or {}).get(design, design), d.params, d.attention_params,
         None if math.isnan(d.macs_per_token) else d.macs_per_token, d.score_cell or None,
         d.kv_bytes_per_token, "; ".join(d.notes) or None]
        for design, d in described.items()
    ]  # fmt: skip
    return fields, rows


def equal_terms_section(described: dict[str, Description], names=None) -> str:
    """The equal-terms table, each figure as a multiple of the first design's beside it."""
    fields, rows = equal_terms_rows(described, names)
    first = rows[0] if rows else None
    cells = []
    for row in rows:
        line = [str(row[0])]
        for i in (1, 2, 3):
            mine, theirs = row[i], first[i]
            ratio = f" (×{mine / theirs:.3f})" if mine and theirs and row is not first else ""
            line.append(format_cell(mine, ",.0f") + ratio)
        line += [row[4] or MISSING, format_cell(row[5], ",d"), row[6] or ""]
        cells.append(line)
    return "\n".join([
        "\n## Equal terms: what else differs between the designs\n",
        "Counted from each design's model, built from its run's saved config "
        "(`multihead.analysis.describe`): parameters, multiply-adds per token of a causal "
        "pass at the trained context (linear maps, convolutions, and each head's `q·k` and "
        "`weights·v` over the keys a query sees), each head's score width and how many of its "
        "features are rotated by position, and the KV cache per decoded token. Each design's "
        "own arithmetic: MLA's kernel here pads V to the score width, which is not counted. "
        "× is against the first design. "
        "A design that differs in more than its cache differs in these too: read a verdict "
        "with them.\n",
        markdown_table(fields[:-1] + ["note"], cells),
    ])  # fmt: skip


def grid_section(grids: dict[str, Grid], names: dict[str, str] | None = None) -> str:
    """Each design's learning rates, the figure each scored, and the rate chosen."""
    rows = []
    for name, grid in grids.items():
        design = (names or {}).get(name, name)
        for rate, pool in grid.runs.items():
            chosen = "**chosen**" if rate == grid.chosen else ""
            if rate == grid.chosen and len(grid.runs) == 1:
                chosen = "one grid point: nothing to choose"
            elif rate == grid.chosen and grid.edge:
                chosen += " (at the grid's edge: extend the grid)"
            score = grid.scores.get(rate)
            shown = MISSING if score is None else f"{score:.4f}"
            rate_cell = MISSING if rate is None else f"{rate:g}"
            scored = len(grid.scored(rate))
            runs = str(scored) if scored == len(pool) else f"{scored} of {len(pool)}"
            rows.append([design, rate_cell, runs, grid.metric, shown, chosen])
    return "\n".join([
        "\n## Learning rates\n",
        "Each design's runs by learning rate (`module.optimizer.lr`): the rate with the best "
        "mean of the grid's figure, on a split the tests do not score, over the seeds every "
        "rate ran, is the design's own, and only its runs at that rate enter the tests. Seeds "
        "run at the chosen rate after it was chosen do not score it (\"1 of 3\": the mean "
        "reads one of the rate's three runs). A best rate at the grid's edge asks for a "
        "wider grid.\n",
        markdown_table(["design", "learning rate", "runs scored", "chosen by", "mean", "choice"],
                       rows),
    ])  # fmt: skip


def curve_rows(designs: dict[str, dict[Any, RunResult]], key: str, names=None):
    """Per design, the mean over its runs of ``key`` at each evaluation during training
    (:func:`~multihead.analysis.tested.evaluations`); ``(steps, {design: [mean or None]})``."""
    curves = {
        design: [dict(evaluations(run.curves[key])) for run in seeds.values() if key in run.curves]
        for design, seeds in designs.items()
    }
    steps = sorted({s for found in curves.values() for c in found for s in c})
    rows = {}
    for design, found in curves.items():
        means = []
        for step in steps:
            values = [c[step] for c in found if step in c]
            means.append(statistics.fmean(values) if len(values) == len(found) and values else None)
        rows[(names or {}).get(design, design)] = means
    return steps, rows


def curves_section(designs: dict[str, dict[Any, RunResult]], keys: list[str], names=None,
                   figure: str | None = None) -> str:  # fmt: skip
    """The learning curves: each design's mean figure at every evaluation, per key."""
    parts = [
        "\n### Learning curves\n",
        "Each design's mean over its runs (at its chosen rate) at every evaluation during "
        "training, on the held-out data. A verdict below is stated only where the order "
        "against the baseline agrees at the last two evaluations.",
    ]
    counts = {len(evaluations(c)) for s in designs.values() for r in s.values()
              for k, c in r.curves.items() if k in keys}  # fmt: skip
    if counts and min(counts) < 5:
        parts.append(
            f"**These runs were evaluated at {min(counts)} points during training**, fewer "
            "than the five a verdict about what a design can do needs."
        )
    if figure:
        parts.append(f"\n![learning curves]({figure})")
    for key in keys:
        steps, rows = curve_rows(designs, key, names)
        if not steps:
            continue
        table = [[d, *(format_cell(v, ".4f") for v in means)] for d, means in rows.items()]
        parts.append(f"\n**{key}**\n\n" + markdown_table(["design", *map(str, steps)], table))
    return "\n".join(parts)


def family_section(
    tests: dict[tuple[str, str, str, str], SeedTest], family: Family | None,
    runs: list[RunResult], names=None,
) -> str:  # fmt: skip
    """How the tests were corrected: the declared family, its Holm table, the declared
    tests without runs, and the exploratory tests apart."""
    if family is None:
        return (
            "\n## The family of tests\n\nNo family of tests was declared (`family=null`): Holm "
            "runs over the designs of each figure, and every verdict is exploratory in the "
            "sense of a declared analysis. Declare one in a file written before the runs "
            "(`family=PATH`)."
        )
    show = (names or {}).get
    starts = [(run, run.get("run/start")) for run in runs]
    early = [run for run, start in starts if start and utc_time(start) < family.declared]
    parts = [
        "\n## The family of tests\n",
        f"Holm's step-down adjustment runs over the {family_words(family)}; a test the report "
        "makes outside it (not listed, or added after the declaration) is exploratory and "
        "keeps its unadjusted p.",
    ]
    if early:
        parts.append(
            f"{len(early)} of the {len(runs)} runs started before the family was declared "
            "(reused runs, whose results could be seen when it was written)."
        )
    longer = any(test.longer for test in tests.values())
    if longer:
        parts.append(
            "The designs were also trained longer (the same runs, `trainer.max_steps` alone "
            "larger, at each design's chosen rate; the schedule's warm-up and cooldown "
            "scale with it). An order verdict (lower, higher, no detectable difference) is "
            "checked by its sign, against the verdict's (the mean over every seed) and against "
            "the same seeds' at the compared budget (so that the budget is all that changes): "
            "where the order is the other way round there, or a tie, or a tie broken, the "
            "verdict is about learning speed at the compared budget; where the order holds but the "
            "difference lies outside the compared interval, the size belongs to the compared "
            "budget alone. An equivalence claims a size, so it is checked by its margin: "
            "where the difference at the last two evaluations or trained longer lies outside "
            "it, the verdict is about learning speed at the compared budget."
        )
    rows, explore = [], []
    for (task, design, base, metric), test in tests.items():
        cells = [task, show(design, design) if task != "translation" else design,
                 show(base, base) if task != "translation" else base, metric,
                 MISSING if test.interval is None else f"{test.interval[0]:+.4f}",
                 p_cell(test.p_value)]  # fmt: skip
        last = [MISSING if test.last_two is None else (
            f"{test.last_two[0]:+.4f} → {test.last_two[1]:+.4f}")]  # fmt: skip
        if longer:
            last.append(MISSING if test.longer is None else (
                f"{test.longer[3]:+.4f} → {test.longer[1]:+.4f} at {test.longer[0]} "
                f"({test.longer[2]} seed{'s' if test.longer[2] > 1 else ''})"))  # fmt: skip
        if test.exploratory:
            explore.append([*cells, *last, test.verdict])
        else:
            rows.append([*cells, p_cell(test.p_adjusted), *last, test.verdict])
    heads = ["task", "design", "baseline", "figure", "mean Δ", "p (paired t)"]
    ends = [
        "Δ at the last two evaluations",
        *(["Δ of the same seeds → trained longer (steps)"] if longer else []),
    ]
    parts.append(
        "\n"
        + markdown_table(
            [*heads, f"p ({CORRECTION}, the family)", *ends, "verdict"], rows
        )  # fmt: skip
    )
    found = {k for k, t in tests.items() if not t.exploratory}
    missing = [t for t in family.confirmatory
               if not any(t.matches(*k) for k in found)]  # fmt: skip
    if missing:
        listed = "; ".join(f"{t.task} {t.design} vs {t.baseline} on {t.metric}"
                           for t in missing[:8])  # fmt: skip
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        parts.append(
            f"\n{len(missing)} declared tests have no runs yet (each counts as p = 1): "
            f"{listed}{more}."
        )
    if explore:
        parts += [
            "\n### Exploratory tests (outside the declared family; p unadjusted)\n",
            markdown_table([*heads, *ends, "verdict"], explore),
        ]
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------
# The long-context comparison: the LM's loss by position, MQAR's accuracy by setting

# Margins for "equal", set before the runs: 0.02 nats of held-out loss (a 2% perplexity
# ratio) and 2 points of MQAR accuracy.
LOSS_MARGIN = 0.02
ACC_MARGIN = 0.02
LONG_CONTEXT_FILES = ("long_context.md", "long_context.csv")


def _mean_sd(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"


def _test_cells(test: SeedTest | None, digits: int = 4) -> list[str]:
    if test is None or test.interval is None:
        deltas = "" if test is None else ", ".join(f"{d:+.{digits}f}" for d in test.deltas)
        return [deltas, "", "", "", "", "one seed: no test" if test else ""]
    mean, low, high = test.interval
    p = test.p_value if test.exploratory else test.p_adjusted
    return [
        ", ".join(f"{d:+.{digits}f}" for d in test.deltas),
        f"**{mean:+.{digits}f}**, {low:+.{digits}f} to {high:+.{digits}f}",
        "< 0.001" if p < 0.001 else f"{p:.3f}",
        "" if test.detectable is None else f"±{test.detectable:.{digits}f}",
        "" if test.tost is None else f"{test.tost:.3f}",
        test.verdict,
    ]


def quality_section(designs, tests, task: str, keys: list[str], margin: float, what: str,
                    names: dict[str, str]) -> str:  # fmt: skip
    """Per figure: each design's mean ± sd over seeds, and its test against plain MHA."""
    parts = []
    mha = next((d for d, seeds in designs.items()  # by_design puts variants last
                if is_mha_design(next(iter(seeds.values())))), None)  # fmt: skip
    for key in keys:
        rows = []
        for design, seeds in designs.items():
            values = [number(r.get(key)) for r in seeds.values() if r.get(key) is not None]
            if not values:
                continue
            if design == mha:
                cells = [""] * 5 + ["(the reference)"]
            else:
                cells = _test_cells(tests.get((task, design, mha, key)))
            rows.append([names[design], str(len(values)), _mean_sd(values), *cells])
        headers = [
            "design", "seeds", f"{what} (mean ± sd)", "Δ vs MHA per seed",
            "mean Δ, 95% t-interval", "p, Holm", "detectable",
            f"TOST ±{margin:g}", "verdict",
        ]  # fmt: skip
        parts.append(f"**{key}**\n\n" + markdown_table(headers, rows))
    return "\n\n".join(parts)


def speed_section(rows: list[dict[str, Any]]) -> str:
    order = {"mha": 0, "gqa": 1, "mqa": 2, "mla": 3}
    headers = [
        "design", "context x batch", "ms/token, median (min-max of rounds)",
        "speed x MHA, median (min-max)", "cache MiB held", "rounds",
    ]  # fmt: skip
    lines = []
    for r in sorted(rows, key=lambda r: (r["context"], r["batch"], order.get(r["design"], 9))):
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
    return markdown_table(headers, lines)


def context_use_section(designs, first: str, last: str, names: dict[str, str]) -> str:
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
            rows.append([names[design], per_seed, f"{statistics.fmean(gains):+.2f}%"])
    what = f"Context use: the loss at {last.split('@')[1]} below the loss at {first.split('@')[1]}"
    return f"**{what}**\n\n" + markdown_table(["design", "per seed", "mean"], rows)


def package_section(designs, names: dict[str, str]) -> str:
    """The held-out loss of each source package (``val/loss/NAME``), each design's mean over
    its seeds; empty where the runs logged none."""
    packages = sorted({k for s in designs.values() for r in s.values() for k in r.summary
                       if k.startswith("val/loss/")})  # fmt: skip
    if not packages:
        return ""
    rows = []
    for design, seeds in designs.items():
        means = []
        for key in packages:
            values = [number(r.get(key)) for r in seeds.values() if r.get(key) is not None]
            means.append(format_cell(statistics.fmean(values) if values else None, ".4f"))
        rows.append([names[design], *means])
    headers = ["design", *(k.removeprefix("val/loss/") for k in packages)]
    return (
        "**Held-out loss by source package** (mean over seeds; the scored windows are drawn "
        "from every package in proportion to its bytes)\n\n" + markdown_table(headers, rows)
    )


def runs_section(designs, names: dict[str, str]) -> str:
    rows = []
    for design, seeds in designs.items():
        run = next(iter(seeds.values()))
        rows.append([names[design], design, ", ".join(str(s) for s in seeds),
                     str(run.get("steps"))])  # fmt: skip
    return markdown_table(["design", "run name", "seeds", "steps"], rows)


def lm_markdown(
    tasks: dict[str, dict[str, dict[Any, RunResult]]], keys: dict[str, list[str]],
    tests, report: Report, speed_rows: list[dict[str, Any]] | None, figures: dict[str, str],
) -> str:  # fmt: skip
    """The text of ``long_context.md``."""
    parts = ["# What each design costs and buys at long context\n"]
    grouped = report.grouped
    if grouped is not None and grouped.despite:
        parts.append(pooled_despite_note(grouped.despite).strip() + "\n")
    for task, designs in tasks.items():
        names = report_names(designs)
        title, what = {"lm": ("The language model", "held-out loss, nats"),
                       "mqar": ("MQAR", "accuracy")}[task]  # fmt: skip
        margin = LOSS_MARGIN if task == "lm" else ACC_MARGIN
        parts += [f"## {title}\n", runs_section(designs, names)]
        described = {d: report.described[(task, d)] for d in designs
                     if (task, d) in report.described}  # fmt: skip
        parts.append(equal_terms_section(described, names).replace("\n## ", "\n### "))
        if grouped is not None:
            mine = {k.split(": ", 1)[-1]: g for k, g in grouped.grids.items()
                    if k.startswith(f"{task}: ") or ": " not in k}  # fmt: skip
            parts.append(grid_section(mine, names).replace("\n## ", "\n### "))
        parts.append(curves_section(designs, keys[task], names, figures.get(task)))
        parts.append("\n### Against MHA\n")
        if task == "lm":
            parts += [context_use_section(designs, keys[task][1], keys[task][-1], names), ""]
            parts += [package_section(designs, names), ""]
        parts += [quality_section(designs, tests, task, keys[task], margin, what, names),
                  ""]  # fmt: skip
    if speed_rows:
        parts += ["## Decoding the trained checkpoints\n", speed_section(speed_rows), ""]
    all_names = {d: n for designs in tasks.values() for d, n in report_names(designs).items()}
    runs = [r for designs in tasks.values() for s in designs.values() for r in s.values()]
    parts.append(family_section(tests, report.family, runs, all_names))
    return "\n".join(parts) + "\n"


def report_names(designs) -> dict[str, str]:
    return display_names(designs)


def long_context_rows(tasks, keys) -> list[dict[str, Any]]:
    """The rows of ``long_context.csv``: each run's figures."""
    rows = []
    for task, designs in tasks.items():
        extra = ["val/ppl"] if task == "lm" else []
        for design, seeds in designs.items():
            name = report_names(designs)[design]
            for seed, run in seeds.items():
                rows.append({"task": task, "design": name, "seed": seed,
                             **{k: run.get(k) for k in keys[task] + extra}})  # fmt: skip
    return rows


def learning_curve_rows(runs: list[RunResult]) -> tuple[list[str], list[list[Any]]]:
    """Every run's held-out figures at every evaluation during training, one row each: the
    wandb table ``learning_curves`` (and ``learning_curves.csv`` of the LM comparison)."""
    from multihead.analysis.groups import task

    fields = ["task", "design", "seed", "learning rate", "figure", "step", "value"]
    rows = [
        [task(run), design_of(run), run.seed, learning_rate(run), key, step, found]
        for run in runs
        for key, curve in sorted(run.curves.items())
        for step, found in evaluations(curve)
    ]
    return fields, rows


def tested_rows(tests: dict[tuple[str, str, str, str], SeedTest]) -> tuple[list[str], list[list]]:
    """Every test, unformatted: the wandb table ``tests``."""
    fields = ["task", "design", "baseline", "figure", "Δ (mean)", "Δ low", "Δ high",
              "p (paired t)", f"p ({CORRECTION})", "exploratory", "Δ at the second-last evaluation",
              "Δ at the last evaluation", "longer budget (steps)", "Δ at the longer budget",
              "seeds at the longer budget", "Δ of the same seeds at the compared budget",
              "verdict"]  # fmt: skip
    rows = []
    for (task, design, base, metric), test in tests.items():
        mean, low, high = test.interval or (statistics.fmean(test.deltas), None, None)
        last = test.last_two or (None, None)
        longer = test.longer or (None, None, None, None)
        rows.append([task, design, base, metric, mean, low, high, test.p_value,
                     test.p_adjusted, test.exploratory, *last, *longer, test.verdict])  # fmt: skip
    return fields, rows
