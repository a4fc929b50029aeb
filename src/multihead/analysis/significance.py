"""Is a run's test BLEU different from its MHA baseline's? sacreBLEU's paired tests, and a
Student-t interval over seeds.

Per pair of runs (same seed, same test set): sacreBLEU's paired bootstrap resampling
(Koehn 2004) or paired approximate randomization (Riezler and Maxwell 2005), through
``sacrebleu.significance.PairedTest``, the code behind ``sacrebleu REF -i A B --paired-bs``
(``--paired-ar``): the same resamples for the same ``SACREBLEU_SEED`` (default 12345), so
the p-values equal the command line's. Over seeds: the mean of the paired differences with a
Student-t 95% interval.

The interval of the difference is the one figure ``PairedTest`` does not give: it reports
each system's own mean and interval, not those of the difference. We draw the resamples as
sacreBLEU's bootstrap draws them (``numpy.random.default_rng(seed).choice``, the same seed,
so the same resamples) and score them with the sacreBLEU metric's own sufficient statistics,
as its ``_paired_bs_test`` does; the interval's ends are the 2.5 and 97.5 percentiles by
sacreBLEU's own rule (``estimate_ci``: the ``n // 40``-th resample from either end).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import sacrebleu
from sacrebleu.significance import PairedTest

from multihead.evaluation.metrics import lc_tok

# What the BLEU of the tests is, by name: how the lines are prepared, and sacreBLEU's tokenizer.
METRICS = {
    "lc-tok": "lowercased, Moses-normalized and -tokenized BLEU (sacreBLEU tokenize=none), "
    "as the Multi30k papers and this project's docs report it",
    "sacrebleu": "cased, detokenized sacreBLEU (tokenize=13a)",
}
TESTS = {"bs": "paired bootstrap resampling", "ar": "paired approximate randomization"}
DEFAULT_SAMPLES = {"bs": 1000, "ar": 10000}  # sacreBLEU's own defaults
BOOTSTRAP_SAMPLES = 1000  # resamples for the interval of the difference under ``ar``


@dataclass(frozen=True)
class PairedResult:
    """One system against its baseline on the same sentences."""

    score: float  # the system's corpus BLEU
    baseline: float  # the baseline's
    low: float  # the 95% interval of the difference (paired bootstrap)
    high: float
    p_value: float  # sacreBLEU's
    test: str  # "bs" or "ar"
    samples: int  # resamples (bs) or trials (ar)

    @property
    def delta(self) -> float:
        return self.score - self.baseline

    @property
    def holds_zero(self) -> bool:
        return self.low <= 0.0 <= self.high


def sacrebleu_seed() -> int | None:
    """The seed sacreBLEU's tests use: ``SACREBLEU_SEED``, default 12345, ``none`` = unseeded."""
    seed = os.environ.get("SACREBLEU_SEED", "12345")
    return None if seed.lower() == "none" else int(seed)


def check_options(test: str = "bs", metric: str = "lc-tok", samples: int = 0) -> None:
    """Raise ``ValueError`` naming the option for a test, metric or sample count not known."""
    if test not in TESTS:
        raise ValueError(f"significance.test={test!r}; expected one of {', '.join(TESTS)}")
    if metric not in METRICS:
        raise ValueError(f"significance.metric={metric!r}; expected one of {', '.join(METRICS)}")
    if samples < 0:
        raise ValueError(f"significance.samples={samples}; expected >= 0 (0: sacreBLEU's default)")


def prepare(lines: Sequence[str], metric: str, lang: str | None) -> list[str]:
    """The lines as ``metric`` scores them: lc-tok prepares them with
    :func:`~multihead.evaluation.metrics.lc_tok`, sacrebleu keeps them."""
    check_options(metric=metric)
    if metric == "sacrebleu":
        return list(lines)
    if not lang:
        raise ValueError(
            "significance.metric=lc-tok needs the target language for the Moses tokenizer: "
            "set significance.lang (e.g. de) or give runs with a .hydra/config.yaml"
        )
    return lc_tok(list(lines), lang)


def bleu(metric: str) -> sacrebleu.metrics.BLEU:
    check_options(metric=metric)
    if metric == "lc-tok":  # tokenized on purpose: force=True silences sacreBLEU's warning
        return sacrebleu.metrics.BLEU(tokenize="none", force=True)
    return sacrebleu.metrics.BLEU()


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str], metric: str, lang) -> float:
    """Corpus BLEU of ``metric`` (the score the tests compare)."""
    refs = prepare(references, metric, lang)
    return bleu(metric).corpus_score(prepare(hypotheses, metric, lang), [refs]).score


def paired_tests(
    baseline: Sequence[str],
    systems: dict[str, Sequence[str]],
    references: Sequence[str],
    *,
    metric: str = "lc-tok",
    lang: str | None = None,
    test: str = "bs",
    samples: int = 0,
) -> dict[str, PairedResult]:
    """Each of ``systems`` against ``baseline`` (hypotheses, one per reference, in order).

    ``samples``: resamples (``bs``) or trials (``ar``); 0 = sacreBLEU's default (1000 or
    10000). Returns the results by system name.
    """
    check_options(test, metric, samples)
    refs = prepare(references, metric, lang)
    named = [("baseline", prepare(baseline, metric, lang))]
    named += [(name, prepare(hyps, metric, lang)) for name, hyps in systems.items()]
    for name, hyps in named:
        if len(hyps) != len(refs):
            raise ValueError(
                f"{name}: {len(hyps)} hypotheses for {len(refs)} references; expected one "
                "hypothesis per test sentence, in order"
            )
    samples = samples or DEFAULT_SAMPLES[test]
    _, scores = PairedTest(named, {"BLEU": bleu(metric)}, [refs], test, samples)()
    (key,) = [k for k in scores if k != "System"]
    base, *results = scores[key]
    draws = samples if test == "bs" else BOOTSTRAP_SAMPLES
    intervals = delta_intervals(named, refs, metric, draws)
    return {
        name: PairedResult(r.score, base.score, *intervals[name], r.p_value, test, samples)
        for (name, _), r in zip(named[1:], results, strict=True)
    }


def delta_intervals(
    named: list[tuple[str, list[str]]], refs: list[str], metric: str, samples: int
) -> dict[str, tuple[float, float]]:
    """The 95% paired-bootstrap interval of each system's BLEU minus the first's, on the
    resamples sacreBLEU's paired bootstrap draws (see the module's docstring)."""
    scorer = bleu(metric)
    rows = bootstrap_rows(len(refs), samples)
    base = resampled_bleu(scorer, named[0][1], refs, rows)
    return {
        name: percentile_interval(resampled_bleu(scorer, hyps, refs, rows) - base)
        for name, hyps in named[1:]
    }


def bootstrap_rows(sentences: int, samples: int) -> np.ndarray:
    """The sentence indices of sacreBLEU's paired bootstrap: ``(samples, sentences)``, drawn
    as its ``_paired_bs_test`` draws them for ``SACREBLEU_SEED``."""
    seed = sacrebleu_seed()
    rng = np.random.default_rng(seed if seed else None)  # as PairedTest passes it on
    return rng.choice(sentences, size=(samples, sentences), replace=True)


def resampled_bleu(
    scorer: sacrebleu.metrics.BLEU, hyps: Sequence[str], refs: list[str], rows: np.ndarray
) -> np.ndarray:
    """Corpus BLEU of each resample (a row of sentence indices), from the metric's
    sufficient statistics as sacreBLEU's bootstrap scores them."""
    stats = np.array(scorer._extract_corpus_statistics(hyps, [refs]), dtype="float32")
    return np.array([scorer._compute_score_from_stats(s.sum(0)).score for s in stats[rows]])


def percentile_interval(values: np.ndarray) -> tuple[float, float]:
    """The 95% interval by sacreBLEU's own rule (``estimate_ci``): the ``n // 40``-th value
    from either end."""
    values, lower = np.sort(values), len(values) // 40
    return float(values[lower]), float(values[len(values) - lower - 1])


@dataclass(frozen=True)
class PooledResult:
    """A system against its baseline, its BLEU difference averaged over seeds."""

    delta: float  # mean over seeds of the system's corpus BLEU minus the baseline's
    seed_deltas: tuple[float, ...]  # each seed's difference
    low: float  # the 95% paired-bootstrap interval of ``delta``
    high: float
    p_value: float
    samples: int


def pooled_paired_bootstrap(
    baselines: Sequence[Sequence[str]],
    systems: Sequence[Sequence[str]],
    references: Sequence[str],
    *,
    metric: str = "lc-tok",
    lang: str | None = None,
    samples: int = 0,
) -> PooledResult:
    """sacreBLEU's paired bootstrap for one comparison made at several seeds at once.

    ``baselines[s]`` and ``systems[s]`` are seed ``s``'s hypotheses (one per reference, in
    order). The statistic is the BLEU difference averaged over the seeds; each resample
    draws test sentences (the same for every seed, so a sentence's pairs stay together) and
    takes the seeds' mean difference on them; the p-value is sacreBLEU's rule (the resamples'
    absolute differences, centred, against the observed one). With one seed this is
    ``sacrebleu --paired-bs``'s p and :func:`delta_intervals`' interval. The test resamples
    sentences only: the seeds' own spread is not in it (``seed_deltas`` shows it).
    """
    check_options("bs", metric, samples)
    if not baselines or len(baselines) != len(systems):
        raise ValueError(
            f"{len(baselines)} baseline and {len(systems)} system hypothesis sets; expected "
            "one of each per seed, at least one"
        )
    refs = prepare(references, metric, lang)
    scorer, samples = bleu(metric), samples or DEFAULT_SAMPLES["bs"]
    rows = bootstrap_rows(len(refs), samples)
    observed, resampled = [], np.zeros(samples)
    for base, system in zip(baselines, systems, strict=True):
        base, system = prepare(base, metric, lang), prepare(system, metric, lang)
        for hyps in (base, system):
            if len(hyps) != len(refs):
                raise ValueError(
                    f"{len(hyps)} hypotheses for {len(refs)} references; expected one "
                    "hypothesis per test sentence, in order"
                )
        observed.append(
            scorer.corpus_score(system, [refs]).score - scorer.corpus_score(base, [refs]).score
        )
        resampled += resampled_bleu(scorer, system, refs, rows)
        resampled -= resampled_bleu(scorer, base, refs, rows)
    resampled /= len(observed)
    spread = np.abs(resampled)
    beyond = int(np.sum(spread - spread.mean() > abs(statistics.fmean(observed))))
    return PooledResult(
        statistics.fmean(observed), tuple(observed), *percentile_interval(resampled),
        (beyond + 1) / (samples + 1), samples,
    )  # fmt: skip


# Student t's 0.975 quantile by degrees of freedom (any statistics table).
T_975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
    9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120,
    17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064,
    25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042,
}  # fmt: skip


def t_quantile_975(df: int) -> float:
    """Student t's 0.975 quantile: the table up to 30 degrees of freedom, beyond it the
    Cornish-Fisher expansion around the normal quantile (error below 1e-4 there)."""
    if df < 1:
        raise ValueError(f"degrees of freedom {df}; expected >= 1")
    if df in T_975:
        return T_975[df]
    z = statistics.NormalDist().inv_cdf(0.975)
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def t_interval(values: Sequence[float]) -> tuple[float, float, float] | None:
    """``(mean, low, high)``: the mean and its Student-t 95% interval; ``None`` for fewer
    than two values (no spread to estimate)."""
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    half = t_quantile_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


# ---------------------------------------------------------------------------------------
# Over seeds: the paired t-test, Holm's correction, what the test could detect, and TOST.
# Student t's and the noncentral t's tails come from mpmath, which torch installs (torch needs
# sympy, sympy needs mpmath): not an extra of ours, so the core stays torch alone (.ci/run).
# Used: the regularized incomplete beta function and a quadrature over the chi-square density.

ALPHA = 0.05
POWER = 0.80


def t_tail(t: float, df: int) -> float:
    """``P(T > t)`` for Student's t with ``df`` degrees of freedom."""
    import mpmath

    if df < 1:
        raise ValueError(f"degrees of freedom {df}; expected >= 1")
    both = float(mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True))
    return both / 2 if t >= 0 else 1 - both / 2  # ``both`` = P(|T| > |t|)


def t_test_p(values: Sequence[float]) -> float | None:
    """The two-sided p of the one-sample t-test of mean 0 (the paired t-test of per-seed
    differences); ``None`` for fewer than two values, 0.0 for identical nonzero values."""
    if len(values) < 2:
        return None
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    if sd == 0:
        return 1.0 if mean == 0 else 0.0
    return 2 * t_tail(abs(mean) / (sd / math.sqrt(len(values))), len(values) - 1)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of a family of p-values, in their order: the ``i``-th
    smallest is multiplied by ``m - i`` (``i`` from 0), then made non-decreasing and
    capped at 1."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def detectable_difference(sd: float, n: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest true mean difference the two-sided paired t-test at level ``alpha``
    over ``n`` seeds finds with probability ``power``, for per-seed differences of standard
    deviation ``sd``: ``δ · sd / sqrt(n)``, where ``δ`` is the noncentrality at which the
    noncentral t with ``n - 1`` degrees of freedom leaves ``[-c, c]`` with probability
    ``power`` (``c`` the t test's critical value)."""
    import mpmath

    if n < 2:
        raise ValueError(f"n={n} seeds; the t-test needs at least 2")
    if alpha != ALPHA:
        raise ValueError(f"alpha={alpha}; the t quantile table holds only {ALPHA}")
    df, c = n - 1, t_quantile_975(n - 1)
    half, norm = mpmath.mpf(df) / 2, mpmath.gamma(mpmath.mpf(df) / 2) * 2 ** (mpmath.mpf(df) / 2)

    def rejects(delta: float) -> float:  # P(|T'| > c) for noncentrality delta
        def integrand(v):
            edge = c * mpmath.sqrt(v / df)
            density = v ** (half - 1) * mpmath.exp(-v / 2) / norm
            return density * (mpmath.ncdf(delta - edge) + mpmath.ncdf(-delta - edge))

        return float(mpmath.quad(integrand, [0, df, mpmath.inf]))

    delta = float(mpmath.findroot(lambda d: rejects(d) - power, c + 1.0, tol=1e-12))
    return delta * sd / math.sqrt(n)


def tost_p(values: Sequence[float], margin: float) -> float | None:
    """The p of the two one-sided t-tests (TOST) that the mean lies within ``±margin``: the
    larger of ``P(T > (mean + margin) / se)`` and ``P(T < (mean - margin) / se)``; below
    ``ALPHA``, the mean is equivalent to 0 within the margin. ``None`` for fewer than two
    values."""
    if margin <= 0:
        raise ValueError(f"equivalence_margin={margin}; expected a positive BLEU difference")
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    se, df = statistics.stdev(values) / math.sqrt(len(values)), len(values) - 1
    if se == 0:
        return 0.0 if abs(mean) < margin else 1.0
    return max(t_tail((mean + margin) / se, df), 1 - t_tail((mean - margin) / se, df))
