"""Every design against MHA: sacreBLEU's paired tests per seed, and over seeds the paired
t-test with Holm's correction, what it could have detected, and an equivalence test.

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

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multihead.analysis.runs import (
    HYP_BLEU,
    RunResult,
    is_mha,
    number,
    paired_baseline,
    seed_groups,
    seed_means,
)
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
    """The ``data`` settings Hydra saved in the run's ``.hydra/config.yaml``, if any."""
    saved = run.directory / ".hydra" / "config.yaml" if run.directory else None
    if saved is None or not saved.is_file():
        return None
    from omegaconf import OmegaConf

    data = OmegaConf.load(saved).get("data") or {}
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

    @property
    def verdict(self) -> str:
        """Lower or higher where Holm's p is below 0.05; equivalent where TOST passes;
        else no detectable difference."""
        if self.p_adjusted is None:
            return "one seed: no test"
        if self.p_adjusted < ALPHA:
            return "lower" if self.interval[0] < 0 else "higher"
        if self.tost is not None and self.tost < ALPHA:
            return f"equivalent within ±{self.margin:g}"
        return "no detectable difference"


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
