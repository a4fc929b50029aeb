"""The comparison's fourth stage, runs tested: every design against its baseline, paired
by seed, and the whole declared family of tests corrected together.

Translation: sacreBLEU's paired tests per seed; over seeds (all tasks) the paired t-test,
what it could have detected, and an equivalence test. The correction is Holm's, over the
family of tests declared in a file written before the runs (:func:`read_family`, e.g.
``docs/long_context/family.yaml``): each test is a design against a baseline on one figure
(a setting is a figure: ``val/acc@1024x256``). A test the report makes that the family does
not list, or that the family added after its declaration (``added:``), is exploratory: its
unadjusted p stands apart from the family. A declared test without runs counts in the family
as p = 1 (Holm stays conservative). Without a family file, Holm runs over the designs of each
figure, and the report says that no family was declared.

A verdict is stated only where it has stopped moving (:func:`order_at_last_two`): the mean
paired difference has the same sign at the last two evaluations during training (for an
equivalence, lies within its margin there); elsewhere the test says "still moving", a
result about learning speed at this budget.

Per seed, each run is tested against the MHA run of its seed and heads on the test
hypotheses (:func:`add_significance`). Over seeds (:func:`seed_tests`), a configuration's
per-seed differences give a mean with a Student-t interval and the paired t-test's p. All
designs are tested against the same MHA runs, so the p-values are one family: the verdict
comes from Holm's adjustment of them. Beside it stand the smallest difference the test
would have found (80% power) and the p of the two one-sided tests (TOST) that the
difference lies within a margin set in advance; equivalence is claimed only where that
passes. Designs with the same KV-cache size are contrasted with each other by the same test
(:func:`contrasts`).
"""

from __future__ import annotations

import fnmatch
import itertools
import os
import statistics
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from multihead.analysis.groups import (
    BUDGET_KEY,
    design_of,
    flat,
    has_repeats,
    is_mha,
    mha_baseline,
    paired_baseline,
    seed_groups,
    seed_means,
)
from multihead.analysis.groups import task as task_of  # `task` names a key's part below
from multihead.analysis.runs import HYP_BLEU, Curve, RunResult, number
from multihead.analysis.significance import (
    ALPHA,
    METRICS,
    TESTS,
    check_options,
    corpus_bleu,
    detectable_difference,
    holm,
    paired_tests,
    sacrebleu_seed,
    t_interval,
    t_test_p,
    tost_p,
)

HYPOTHESES_FILE = "hypotheses.test.txt"
CORRECTION = "Holm"


def paired_deltas(group: list[RunResult], runs: list[RunResult], bleu_key: str) -> list[float]:
    """Per run of ``group`` that has a paired test, its Δ; otherwise its ``bleu_key`` BLEU
    minus that of the MHA run of the same seed and heads (runs without a seed pair with
    nothing)."""
    deltas = []
    for run in group:
        if run.paired is not None:
            deltas.append(run.paired.delta)
            continue
        base = paired_baseline(run, runs)
        mine = number(run.get(bleu_key))
        theirs = number(base.get(bleu_key)) if base is not None else None
        if mine is not None and theirs is not None:
            deltas.append(mine - theirs)
    return deltas


# ---------------------------------------------------------------------------------------
# Significance against MHA


def read_lines(path: Path) -> list[str]:
    """The lines of a text file, one per sentence (an empty line is an empty output)."""
    text = path.read_text(encoding="utf-8")
    return (text[:-1] if text.endswith("\n") else text).split("\n")


def run_data_config(run: RunResult) -> dict[str, Any] | None:
    """The ``data`` settings of the run's saved config, if it names any."""
    if not (run.config or {}).get("data"):
        return None
    from omegaconf import OmegaConf

    data = OmegaConf.create(run.config)["data"]
    keys = ("name", "src_lang", "tgt_lang", "local_dir", "test_limit")
    return {key: OmegaConf.select(data, key, default=None) for key in keys}


def load_references(
    runs: list[RunResult], references: str | None, local_dir: str | None = None
) -> tuple[list[str], str, Any]:
    """``(references, where from, target language)`` of the test split.

    ``references``: a file, one reference per line; ``None``: the test split named by the
    runs' saved data settings, loaded as ``scripts/evaluate.py`` loads it (all runs must
    name the same corpus and languages), from ``local_dir`` if given, else from the runs'
    ``data.local_dir``.
    """
    configs = [c for run in runs if (c := run_data_config(run)) is not None]
    lang = configs[0]["tgt_lang"] if configs else None
    if references is not None:
        path = Path(references)
        if not path.is_file():
            raise FileNotFoundError(
                f"references={references}: no such file; expected the test references, "
                "one per line, in the order of the hypotheses"
            )
        return read_lines(path), str(path), lang
    if not configs:
        raise ValueError(
            "references=null reads the test split named in the runs' .hydra/config.yaml, "
            "and no run has one; give references=FILE (one reference per line)"
        )
    corpora = {(c["name"], c["src_lang"], c["tgt_lang"]) for c in configs}
    if len(corpora) > 1:
        raise ValueError(
            f"the runs were tested on different corpora {sorted(corpora)}; compare runs of "
            "one corpus, or give references=FILE"
        )
    from multihead.data import load_parallel_dataset

    data = configs[0]
    split = load_parallel_dataset(
        name=data["name"],
        src_lang=data["src_lang"],
        tgt_lang=data["tgt_lang"],
        local_dir=local_dir if local_dir is not None else data["local_dir"],
    )["test"]
    refs = list(split["tgt"])[: data["test_limit"]]
    where = f"the test split of {data['name']} {data['src_lang']}-{data['tgt_lang']}"
    return refs, where, lang


def add_significance(
    runs: list[RunResult],
    *,
    hypotheses: str = HYPOTHESES_FILE,
    references: str | None = None,
    local_dir: str | None = None,
    test: str = "bs",
    metric: str = "lc-tok",
    samples: int = 0,
    lang: str | None = None,
) -> str:
    """Test every non-MHA run against the MHA run of its seed and heads, on the hypotheses
    at ``<run dir>/<hypotheses>``; set each run's ``paired``, ``baseline`` and ``HYP_BLEU``.

    Returns the paragraph that says how the tests were made, which runs had no partner,
    or why there are no tests.
    """
    check_options(test, metric, samples)
    outputs = {}
    for run in runs:
        if run.directory is not None and (run.directory / hypotheses).is_file():
            outputs[run.label] = read_lines(run.directory / hypotheses)
    if not outputs:
        return (
            f"No significance tests: no run has hypotheses at `<run dir>/{hypotheses}` "
            "(runs trained before they wrote them: score them with scripts/evaluate.py and "
            "give hypotheses=<its out dir>/hypotheses.test.txt)."
        )
    refs, where, config_lang = load_references(runs, references, local_dir)
    lang = lang or config_lang
    for run in runs:
        if run.label in outputs:
            if len(outputs[run.label]) != len(refs):
                raise ValueError(
                    f"{run.directory / hypotheses}: {len(outputs[run.label])} lines for "
                    f"{len(refs)} references ({where}); expected one hypothesis per test "
                    "sentence, in order"
                )
            run.summary[HYP_BLEU] = corpus_bleu(outputs[run.label], refs, metric, lang)
    by_baseline: dict[str, tuple[RunResult, list[RunResult]]] = {}
    unpaired = []
    for run in runs:
        if is_mha(run) or run.label not in outputs:
            continue
        base = paired_baseline(run, runs)
        if base is None or base.label not in outputs:
            unpaired.append(run.label)
            continue
        by_baseline.setdefault(base.label, (base, []))[1].append(run)
    for base, systems in by_baseline.values():
        results = paired_tests(
            outputs[base.label],
            {run.label: outputs[run.label] for run in systems},
            refs,
            metric=metric,
            lang=lang,
            test=test,
            samples=samples,
        )
        for run in systems:
            run.paired, run.baseline = results[run.label], base
    tested = next((r.paired for r in runs if r.paired is not None), None)
    text = (
        f"BLEU here is **{metric}**: {METRICS[metric]}, of each run's `{hypotheses}` "
        f"({len(outputs)} of {len(runs)} runs have one) against {len(refs)} references "
        f"({where}). "
    )
    if tested is not None:
        text += (
            f"Each run is tested against the MHA run of its seed and heads by sacreBLEU's "
            f"{TESTS[test]} ({tested.samples} {'resamples' if test == 'bs' else 'trials'}, "
            f"SACREBLEU_SEED {sacrebleu_seed()}; `sacrebleu REF -i MHA RUN --paired-{test}` "
            "gives the same p). Δ is the run's BLEU minus MHA's; its 95% interval comes from "
            "the paired bootstrap resamples. Each seed's verdict is its own, unadjusted; "
            "the verdicts over seeds below are the ones to read."
        )
    if unpaired:
        text += f" No MHA run of the same seed with hypotheses for: {', '.join(unpaired)}."
    return text


def verdict(low: float, high: float, p_value: float | None = None) -> str:
    """What one seed's bootstrap interval of a difference says, unadjusted: nothing
    detectable where it holds 0."""
    if low <= 0.0 <= high:
        return "no detectable difference"
    if p_value is None or p_value < ALPHA:
        return "p<0.05"
    return f"interval excludes 0, p={p_value:.3f}"


# ---------------------------------------------------------------------------------------
# Over seeds


@dataclass(frozen=True)
class SeedTest:
    """Per-seed differences of one configuration against another (MHA, or a design with
    the same KV-cache size), and what the paired t-test over seeds says of them."""

    deltas: tuple[float, ...]
    interval: tuple[float, float, float] | None  # (mean, low, high), Student t 95%
    p_value: float | None  # the paired t-test's, two-sided, unadjusted
    p_adjusted: float | None  # Holm's, over the family the test belongs to
    detectable: float | None  # the difference found with 80% power at these seeds
    tost: float | None  # the p that the difference lies within ±margin
    margin: float | None
    exploratory: bool = False  # not in the declared family: its p is unadjusted
    # the mean difference at the last two evaluations during training; None: no curves
    last_two: tuple[float, float] | None = None
    # (steps, mean difference, seeds, the same seeds' mean difference at the compared
    # budget) of the same runs trained longer; None: none were
    longer: tuple[int, float, int, float] | None = None

    @property
    def moving(self) -> bool:
        """Whether the order changed between the last two evaluations (a tie is an order of
        its own: a lead that appears or vanishes at the last evaluation is still moving)."""
        return self.last_two is not None and _sign(self.last_two[0]) != _sign(self.last_two[1])

    @property
    def flips(self) -> bool:
        """Whether the order differs in the runs trained longer (a tie counts as an order):
        from the verdict's (the mean over all seeds), or from the same seeds' at the
        compared budget, where the budget is all that changed."""
        if self.longer is None:
            return False
        later = _sign(self.longer[1])
        return later != _sign(statistics.fmean(self.deltas)) or later != _sign(self.longer[3])

    @property
    def equivalent(self) -> bool:
        """Whether TOST shows the difference within the margin, in the declared family, where
        Holm finds no difference."""
        return (not self.exploratory and self.p_adjusted is not None
                and self.p_adjusted >= ALPHA and self.tost is not None
                and self.tost < ALPHA)  # fmt: skip

    @property
    def verdict(self) -> str:
        """Lower or higher where Holm's p is below 0.05; equivalent where TOST passes;
        else no detectable difference. An order (lower, higher, none detected) is still
        moving where it changed at the end of training, or is the other way round trained
        longer; an equivalence where a difference there leaves the margin. Exploratory
        outside the declared family."""
        if self.p_value is None:
            return "one seed: no test"
        if self.equivalent:
            # An equivalence is a claim about size, not order: a difference that changes
            # sign inside the margin still supports it, one that leaves the margin does not.
            late = [*(self.last_two or ()), *(self.longer[1:2] if self.longer else ())]
            if any(abs(difference) > self.margin for difference in late):
                return (f"outside ±{self.margin:g} at the end of training or trained longer: "
                        "about learning speed at this budget")  # fmt: skip
            return f"equivalent within ±{self.margin:g}"
        if self.moving:
            return "still moving: about learning speed at this budget"
        if self.flips:
            steps, later, seeds = self.longer[0], _sign(self.longer[1]), self.longer[2]
            mean, same = _sign(statistics.fmean(self.deltas)), _sign(self.longer[3])
            before = mean if mean != later else same
            change = ("the difference vanishes" if later == 0 else "a difference appears"
                      if before == 0 else "the order flips")  # fmt: skip
            whose = "" if mean != later else f" for the seed{'s' * (seeds > 1)} trained longer"
            return f"{change} at {steps} steps{whose}: about learning speed at this budget"
        if self.exploratory:
            return f"exploratory (unadjusted p {self.p_value:.3f})"
        if self.p_adjusted < ALPHA:
            return "lower" if self.interval[0] < 0 else "higher"
        return "no detectable difference"


def _sign(difference: float) -> int:
    """-1, 0 or 1: which of two designs is ahead; 0 where they tie exactly (two MQAR runs
    both at 100%, say), which is neither order."""
    return (difference > 0) - (difference < 0)


def seed_family(deltas: dict[Any, list[float]], margin: float | None) -> dict[Any, SeedTest]:
    """The seed tests of a family of differences (by name), Holm-adjusted together."""
    p_values = {name: t_test_p(values) for name, values in deltas.items()}
    tested = [name for name, p in p_values.items() if p is not None]
    adjusted = dict(zip(tested, holm([p_values[name] for name in tested]), strict=True))
    tests = {}
    for name, values in deltas.items():
        sd = statistics.stdev(values) if len(values) > 1 else None
        tests[name] = SeedTest(
            deltas=tuple(values),
            interval=t_interval(values),
            p_value=p_values[name],
            p_adjusted=adjusted.get(name),
            detectable=detectable_difference(sd, len(values)) if sd else None,
            tost=tost_p(values, margin) if margin is not None else None,
            margin=margin,
        )
    return tests


def seed_tests(runs: list[RunResult], bleu_key: str, margin: float | None) -> dict[str, SeedTest]:
    """Each configuration (run name) with paired runs: its per-seed Δ against MHA
    (:func:`paired_deltas`) tested over seeds, Holm-adjusted over all configurations."""
    deltas = {
        name: found
        for name, group in seed_groups(runs).items()
        if (found := paired_deltas(group, runs, bleu_key))
    }
    return seed_family(deltas, margin)


def contrasts(
    runs: list[RunResult], bleu_key: str, margin: float | None
) -> dict[tuple[str, str], SeedTest]:
    """Designs other than MHA that store the same KV-cache bytes per token, pairwise: the
    first's BLEU minus the second's per shared seed, by the same test as against MHA,
    Holm-adjusted over these contrasts."""
    groups = seed_groups(runs)
    means = dict(zip(groups, seed_means(runs), strict=True))
    names = [n for n, group in groups.items() if not is_mha(group[0])]
    deltas = {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            cache = means[a].get("kv_cache/bytes_per_token")
            if cache is None or cache != means[b].get("kv_cache/bytes_per_token"):
                continue
            theirs = {run.seed: number(run.get(bleu_key)) for run in groups[b]}
            found = [
                mine - theirs[run.seed]
                for run in groups[a]
                if run.seed is not None
                and (mine := number(run.get(bleu_key))) is not None
                and theirs.get(run.seed) is not None
            ]
            if found:
                deltas[a, b] = found
    return seed_family(deltas, margin)


def tests_against(
    designs: dict[str, dict[Any, RunResult]], baseline: str, key: str, margin: float
) -> dict[str, SeedTest]:
    """Per design other than ``baseline``, its ``key`` minus the baseline's of the same
    seed, tested over seeds; Holm over the designs (a family file replaces it)."""
    base = designs.get(baseline, {})
    deltas = {}
    for design, seeds in designs.items():
        if design == baseline:
            continue
        found = [
            number(run.get(key)) - number(base[seed].get(key))
            for seed, run in seeds.items()
            if seed in base and run.get(key) is not None and base[seed].get(key) is not None
        ]
        if found:
            deltas[design] = found
    return seed_family(deltas, margin)


# ---------------------------------------------------------------------------------------
# Learning curves: has the order stopped moving?


def evaluations(curve: Curve) -> Curve:
    """A curve's evaluations, one per point of training: the final evaluation a few steps
    after the last validation (one step on MQAR, the LM's 800 after 797) is the same point,
    so an evaluation at most a tenth of the curve's usual spacing after the one before
    replaces it (the November LM's 800 after 749, 51 steps on, stays a point of its own).
    Counted as two, the order "at the last two evaluations" would compare a run with itself
    three updates on, and could never be seen to move."""
    steps = [step for step, _ in curve]
    gaps = [later - earlier for earlier, later in itertools.pairwise(steps)]
    close = max(1.0, statistics.median(gaps) / 10) if gaps else 1.0
    kept: Curve = []
    for step, value in curve:
        if kept and step - kept[-1][0] <= close:
            kept[-1] = (step, value)
        else:
            kept.append((step, value))
    return kept


def curve_key(runs: list[RunResult], key: str) -> str | None:
    """The curve that tracks figure ``key`` during training: its own, else the validation
    BLEU for a test BLEU; ``None`` where the runs kept none."""
    for candidate in (key, "val/bleu" if key.startswith("test/") else None):
        if candidate and runs and all(candidate in run.curves for run in runs):
            return candidate
    return None


def order_at_last_two(
    runs: list[RunResult], baselines: dict[Any, RunResult], key: str
) -> tuple[float, float] | None:
    """The mean paired difference (run minus its seed's baseline) of ``key``'s curve at the
    last two evaluations the runs share; ``None`` without two."""
    pairs = [(run, baselines[run.seed]) for run in runs if run.seed in baselines]
    found = curve_key([r for pair in pairs for r in pair], key)
    if not pairs or found is None:
        return None
    curves = [(dict(evaluations(a.curves[found])), dict(evaluations(b.curves[found])))
              for a, b in pairs]  # fmt: skip
    steps = sorted(set.intersection(*(set(a) & set(b) for a, b in curves)))
    if len(steps) < 2:
        return None
    diffs = [statistics.fmean(a[s] - b[s] for a, b in curves) for s in steps[-2:]]
    return diffs[0], diffs[1]


def with_longer(
    tests: dict[TestKey, SeedTest],
    longer: dict[tuple[str, str], dict[Any, RunResult]],
    compared: list[RunResult],
) -> dict[TestKey, SeedTest]:
    """``tests`` with the mean difference of their designs trained longer (``longer``:
    ``{(task, design): {seed: run}}``, :func:`~multihead.analysis.groups.longer_budget`),
    over the seeds both the design and its baseline were trained longer at, and the mean
    difference of the same seeds at the compared budget (``compared``: the compared runs):
    a longer run is read against its own seed, so that the budget is all that changes."""
    short: dict[tuple[str, str], dict[Any, RunResult]] = {}
    for run in compared:
        short.setdefault((task_of(run), design_of(run)), {})[run.seed] = run
    found = {}
    for key, test in tests.items():
        task, design, baseline, metric = key
        runs, base = longer.get((task, design), {}), longer.get((task, baseline), {})
        mine, theirs = short.get((task, design), {}), short.get((task, baseline), {})
        pairs = []  # (trained longer, at the compared budget) per seed
        for seed in runs.keys() & base.keys() & mine.keys() & theirs.keys():
            values = [number(r[seed].get(metric)) for r in (runs, base, mine, theirs)]
            if None not in values:
                pairs.append((values[0] - values[1], values[2] - values[3]))
        if not pairs:
            found[key] = test
            continue
        steps = int(number(flat(next(iter(runs.values())).config).get(BUDGET_KEY)))
        later, before = (statistics.fmean(column) for column in zip(*pairs, strict=True))
        found[key] = replace(test, longer=(steps, later, len(pairs), before))
    return found


# ---------------------------------------------------------------------------------------
# The declared family


@dataclass(frozen=True)
class FamilyTest:
    """One declared test: ``design`` against ``baseline`` on ``metric`` in ``task``
    (design names are run names, or globs of them); ``added``: when, if after the family."""

    task: str
    design: str
    baseline: str
    metric: str
    added: datetime | None = None

    def matches(self, task: str, design: str, baseline: str, metric: str) -> bool:
        return (
            self.task == task
            and self.metric == metric
            and fnmatch.fnmatchcase(design, self.design)
            and fnmatch.fnmatchcase(baseline, self.baseline)
        )


@dataclass(frozen=True)
class Family:
    """The tests declared in ``path`` on ``declared`` (at ``commit``), before the runs."""

    path: str
    declared: datetime
    commit: str
    tests: tuple[FamilyTest, ...]

    @property
    def confirmatory(self) -> tuple[FamilyTest, ...]:
        """The tests declared with the family, not added after it."""
        return tuple(t for t in self.tests if t.added is None or t.added <= self.declared)


def _moment(value: Any, where: str) -> datetime:
    if isinstance(value, datetime):
        moment = value
    else:
        try:
            moment = datetime.fromisoformat(str(value))
        except ValueError:
            moment = None
        if moment is None or "T" not in str(value):
            raise ValueError(
                f"{where}={value!r}: expected an ISO 8601 date and time, e.g. "
                "2026-12-06T06:30:00+00:00"
            )
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def read_family(path: str | os.PathLike) -> Family:
    """The family file at ``path``: ``declared`` (ISO date and time), ``commit``, and
    ``tests``, a list of ``{task, baseline, designs: [...], metrics: [...], added?}`` (each
    entry the product of its designs and metrics); one-line errors for anything else."""
    import yaml

    where = f"family={path}"
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"{where}: expected a YAML family file ({type(err).__name__})") from None
    if not isinstance(data, dict) or not isinstance(data.get("tests"), list):
        raise ValueError(f"{where}: expected a mapping with declared, commit and a list of tests")
    declared = _moment(data.get("declared"), f"{where}: declared")
    tests = []
    for i, entry in enumerate(data["tests"]):
        needed = {"task", "baseline", "designs", "metrics"}
        if not isinstance(entry, dict) or not needed <= entry.keys():
            raise ValueError(f"{where}: tests[{i}] needs {', '.join(sorted(needed))}")
        unknown = set(entry) - needed - {"added"}
        if unknown:
            raise ValueError(
                f"{where}: tests[{i}] has unknown key(s) {sorted(unknown)}; expected "
                f"{', '.join(sorted(needed | {'added'}))}"
            )
        added = entry.get("added")
        added = None if added is None else _moment(added, f"{where}: tests[{i}].added")
        for design in entry["designs"]:
            for metric in entry["metrics"]:
                tests.append(
                    FamilyTest(
                        str(entry["task"]), str(design), str(entry["baseline"]), str(metric), added
                    )  # fmt: skip
                )
    return Family(str(path), declared, str(data.get("commit") or "unrecorded"), tuple(tests))


# A test the report made: (task, design, baseline, metric).
TestKey = tuple[str, str, str, str]


def apply_family(tests: dict[TestKey, SeedTest], family: Family) -> dict[TestKey, SeedTest]:
    """``tests`` with Holm's p over the whole ``family`` (declared tests without runs count
    as p = 1), and those outside it (not listed, or added after) marked exploratory."""
    declared = family.confirmatory
    in_family = {k: t for k, t in tests.items() if any(d.matches(*k) for d in declared)}
    tested = [k for k, t in in_family.items() if t.p_value is not None]
    untested = max(len(declared) - len(tested), 0)
    p_values = [in_family[k].p_value for k in tested] + [1.0] * untested
    adjusted = dict(zip(tested, holm(p_values)[: len(tested)], strict=True))
    return {
        key: replace(test, p_adjusted=adjusted.get(key), exploratory=key not in in_family)
        for key, test in tests.items()
    }


def with_curves(
    tests: dict[TestKey, SeedTest], designs: dict[tuple[str, str], dict[Any, RunResult]]
) -> dict[TestKey, SeedTest]:
    """``tests`` with the mean paired difference at the last two evaluations
    (:func:`order_at_last_two`); ``designs``: ``{(task, design): {seed: run}}``."""
    found = {}
    for key, test in tests.items():
        task, design, baseline, metric = key
        runs, base = designs.get((task, design), {}), designs.get((task, baseline), {})
        found[key] = replace(test, last_two=order_at_last_two(list(runs.values()), base, metric))
    return found


def long_context_tests(
    designs: dict[str, dict[str, dict[Any, RunResult]]],
    figures: dict[str, list[str]],
    margins: dict[str, float],
    family: Family | None,
) -> dict[TestKey, SeedTest]:
    """Every LM and MQAR test: per task (``designs``: ``{task: {design: {seed: run}}}``) and
    figure, each design against the plain MHA design, and each pair the family declares;
    Holm over the family where there is one (else over the designs of each figure), the
    order at the last two evaluations beside each."""
    tests: dict[TestKey, SeedTest] = {}
    for task, by_design in designs.items():
        mha = next((d for d, seeds in by_design.items()  # by_design puts variants last
                    if is_mha_design(next(iter(seeds.values())))), None)  # fmt: skip
        pairs = [(d, mha) for d in by_design if mha is not None and d != mha]
        if family is not None:
            pairs += [
                (d, b)
                for t in family.tests
                if t.task == task
                for d in by_design
                for b in by_design
                if d != b and (d, b) not in pairs and t.matches(task, d, b, t.metric)
            ]
        for baseline in dict.fromkeys(b for _, b in pairs):
            mine = {d: s for d, s in by_design.items() if (d, baseline) in pairs or d == baseline}
            for key in figures[task]:
                found = tests_against(mine, baseline, key, margins[task])
                tests |= {(task, d, baseline, key): t for d, t in found.items()}
    tests = with_curves(tests, {(t, d): s for t, ds in designs.items() for d, s in ds.items()})
    return tests if family is None else apply_family(tests, family)


def is_mha_design(run: RunResult) -> bool:
    """The LM's reference: plain MHA heads with rotary positions on every feature."""
    tag, heads = run.get("tag"), run.get("num_heads")
    return run.get("kind") == "mha" and (tag is None or tag in (f"mha{heads}", f"mha{heads}-rope"))


def bleu_key(runs: list[RunResult]) -> str:
    """The BLEU the tests compare: the hypotheses' where every run has it, else the runs'."""
    return HYP_BLEU if runs and all(run.get(HYP_BLEU) is not None for run in runs) else "test/bleu"


def translation_tests(
    runs: list[RunResult], key: str, margin: float | None, family: Family | None
) -> dict[TestKey, SeedTest]:
    """The translation tests over seeds: each design against the MHA run of its heads and
    the contrasts of designs of one cache size, with the order at the last two evaluations
    of the validation BLEU, and Holm over the family where there is one."""
    if not has_repeats(runs):
        return {}
    groups = seed_groups(runs)
    keyed: dict[TestKey, SeedTest] = {}
    for name, test in seed_tests(runs, key, margin).items():
        base = mha_baseline(groups[name][0], runs)
        keyed["translation", name, design_of(base) if base else "MHA", key] = test
    keyed |= {("translation", a, b, key): t for (a, b), t in contrasts(runs, key, margin).items()}
    seeds = {("translation", d): {run.seed: run for run in g} for d, g in groups.items()}
    keyed = with_curves(keyed, seeds)
    return keyed if family is None else apply_family(keyed, family)
