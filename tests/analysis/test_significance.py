"""compare.py's significance: sacreBLEU's paired tests (checked against its command line),
the interval of Δ, Student's t over seeds, and bad input."""

from __future__ import annotations

import csv
import gzip
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
from sacremoses import MosesPunctNormalizer, MosesTokenizer

from multihead.analysis.comparison import compare
from multihead.analysis.significance import (
    detectable_difference,
    holm,
    paired_tests,
    pooled_paired_bootstrap,
    t_quantile_975,
    t_test_p,
    tost_p,
)

from helpers.scripts import assert_one_error_line, run_script

N = 120  # test sentences


@pytest.fixture(scope="module")
def references(multi30k_dir: Path) -> list[str]:
    with gzip.open(multi30k_dir / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        return [line.strip() for _, line in zip(range(N), f, strict=False)]


def system(refs: list[str], every: int, offset: int) -> list[str]:
    """A system that gets every ``every``-th sentence wrong (a reference of another row,
    cased differently) and the others right: known outputs with a known difference."""
    return [
        refs[(i + 7) % len(refs)].upper() if i % every == offset else ref
        for i, ref in enumerate(refs)
    ]


def write_run(root: Path, name: str, kind: str, kv: int, seed: int, lines: list[str], hyp: str):
    run = root / name
    (run / Path(hyp).parent).mkdir(parents=True, exist_ok=True)
    summary = {
        "run_name": f"{kind}-h4-kv{kv}",
        "kind": kind,
        "num_heads": 4,
        "num_kv_heads": kv,
        "seed": seed,
        "test/bleu": 30.0,
        "kv_cache/bytes_per_token": 128 * kv,
    }
    (run / "summary.json").write_text(json.dumps(summary))
    (run / hyp).write_text("".join(f"{line}\n" for line in lines))
    (run / ".hydra").mkdir(exist_ok=True)  # the config training keeps (one without is refused)
    (run / ".hydra" / "config.yaml").write_text(f"seed: {seed}\n")


def lc_tok_by_hand(lines: list[str]) -> list[str]:
    normalize, tokenize = MosesPunctNormalizer("de").normalize, MosesTokenizer("de").tokenize
    return [tokenize(normalize(line.lower()), return_str=True, escape=True) for line in lines]


def sacrebleu_cli(ref: Path, a: Path, b: Path, *options: str) -> list[dict]:
    """``sacrebleu REF -i A B <options>`` run as a program: its JSON, one entry per system."""
    cli = Path(sys.executable).with_name("sacrebleu")
    env = {**os.environ, "SACREBLEU_SEED": "12345"}
    result = subprocess.run(
        [str(cli), str(ref), "-i", str(a), str(b), "-m", "bleu", "-f", "json", *options],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(result.stdout)


@pytest.mark.parametrize(
    "test, metric",
    [("bs", "lc-tok"), ("ar", "lc-tok"), ("bs", "sacrebleu")],
)
def test_compare_gives_the_delta_and_p_of_the_sacrebleu_command_line(
    references, tmp_path: Path, test: str, metric: str
) -> None:
    """Two hand-made runs of seed 1 (MHA and GQA) with known hypotheses, at a path given
    as an option, as evaluate.py writes them: compare.py's Δ and p are those of
    ``sacrebleu REF -i MHA GQA --paired-bs`` (``--paired-ar``) on the same files."""
    mha, gqa = system(references, 3, 0), system(references, 2, 1)
    hyp = "eval_avg6_beam5/hypotheses.test.txt"
    root = tmp_path / "runs"
    write_run(root, "mha", "mha", 4, 1, mha, hyp)
    write_run(root, "gqa", "gqa", 2, 1, gqa, hyp)
    ref_file = tmp_path / "ref.de"
    ref_file.write_text("".join(f"{line}\n" for line in references))
    samples = 200 if test == "bs" else 500
    significance = {"test": test, "metric": metric, "samples": samples, "lang": "de"}
    out = tmp_path / "out"
    compare(out, runs=root, hypotheses=hyp, references=str(ref_file), significance=significance)

    # The command line's inputs: as they are for sacrebleu (13a), prepared by hand for lc-tok.
    files = {"ref": references, "mha": mha, "gqa": gqa}
    options = [f"--paired-{test}", f"--paired-{test}-n", str(samples)]
    if metric == "lc-tok":
        files = {name: lc_tok_by_hand(lines) for name, lines in files.items()}
        options += ["--tokenize", "none", "--force"]
    for name, lines in files.items():
        (tmp_path / f"{name}.txt").write_text("".join(f"{line}\n" for line in lines))
    base, other = sacrebleu_cli(*(tmp_path / f"{n}.txt" for n in files), *options)

    with open(out / "comparison.csv", newline="") as f:
        row = next(r for r in csv.DictReader(f) if r["run"] == "gqa-h4-kv2")
    delta = other["BLEU"]["score"] - base["BLEU"]["score"]
    assert delta < -5  # a real difference: half of GQA's outputs are wrong, a third of MHA's
    assert float(row["paired Δ"]) == pytest.approx(delta, abs=1e-9)
    assert float(row["p"]) == pytest.approx(other["BLEU"]["p_value"], abs=1e-12)
    assert float(row[f"test BLEU {metric} (hypotheses)"]) == pytest.approx(other["BLEU"]["score"])
    assert (
        float(row["Δ low"]) <= float(row["Δ high"]) < 0
        and row["verdict (this seed, unadjusted)"] == "p<0.05"
    )
    md = (out / "comparison.md").read_text()
    assert f"BLEU here is **{metric}**" in md
    assert f"| gqa-h4-kv2 | mha-h4-kv4 | 1 | {other['BLEU']['score']:.2f} |" in md


def test_delta_interval_is_the_bootstrap_percentile_of_bleu_differences(references) -> None:
    """Written out with sacrebleu.corpus_bleu on the resampled sentence lists: the same
    resamples as sacreBLEU's paired bootstrap (default_rng(12345)), the 2.5th and 97.5th
    percentile of the BLEU difference by sacreBLEU's rule (the n // 40-th from each end)."""
    a, b = system(references, 3, 0), system(references, 2, 1)
    samples = 80
    result = paired_tests(a, {"b": b}, references, metric="sacrebleu", samples=samples)["b"]
    rows = np.random.default_rng(12345).choice(N, size=(samples, N), replace=True)

    def bleu(hyps: list[str], picked) -> float:
        return sacrebleu.corpus_bleu(
            [hyps[i] for i in picked], [[references[i] for i in picked]]
        ).score

    deltas = sorted(bleu(b, r) - bleu(a, r) for r in rows)
    assert result.low == pytest.approx(deltas[samples // 40], abs=1e-4)
    assert result.high == pytest.approx(deltas[samples - samples // 40 - 1], abs=1e-4)
    same = paired_tests(a, {"a": a}, references, metric="sacrebleu", samples=samples)["a"]
    assert (same.delta, same.low, same.high) == (0.0, 0.0, 0.0) and same.holds_zero


def test_pooled_bootstrap_at_one_seed_is_sacrebleus_paired_bootstrap(references) -> None:
    """One seed: the p of sacreBLEU's own paired bootstrap (``PairedTest``, the code of
    ``--paired-bs``) on the same files and resamples."""
    a, b = system(references, 3, 0), system(references, 2, 1)
    samples = 200
    pooled = pooled_paired_bootstrap([a], [b], references, metric="sacrebleu", samples=samples)
    expected = paired_tests(a, {"b": b}, references, metric="sacrebleu", samples=samples)["b"]
    assert pooled.p_value == expected.p_value
    assert (pooled.delta, pooled.low, pooled.high) == pytest.approx(
        (expected.delta, expected.low, expected.high), abs=1e-9
    )


def test_pooled_bootstrap_averages_the_seeds_on_the_same_resampled_sentences(references) -> None:
    """Two seeds, written out with sacrebleu.corpus_bleu: each resample (sacreBLEU's
    default_rng(12345) draws) scores both seeds on the same sentences; the statistic is
    the mean of the seeds' differences, the p sacreBLEU's rule (resamples whose centred
    absolute difference exceeds the observed one, plus one, over samples plus one)."""
    seeds = [(system(references, 3, 0), system(references, 2, 1)),
             (system(references, 4, 1), system(references, 5, 2))]  # fmt: skip
    samples = 80
    result = pooled_paired_bootstrap(
        [a for a, _ in seeds], [b for _, b in seeds], references, metric="sacrebleu",
        samples=samples,
    )  # fmt: skip

    def bleu(hyps: list[str], picked) -> float:
        return sacrebleu.corpus_bleu(
            [hyps[i] for i in picked], [[references[i] for i in picked]]
        ).score

    full = range(N)
    observed = [bleu(b, full) - bleu(a, full) for a, b in seeds]
    assert result.seed_deltas == pytest.approx(observed, abs=1e-9)
    assert result.delta == pytest.approx(statistics.fmean(observed), abs=1e-9)
    rows = np.random.default_rng(12345).choice(N, size=(samples, N), replace=True)
    means = np.array([statistics.fmean(bleu(b, r) - bleu(a, r) for a, b in seeds) for r in rows])
    spread = np.abs(means) - np.abs(means).mean()
    assert result.p_value == pytest.approx((np.sum(spread > abs(result.delta)) + 1) / (samples + 1))
    ordered = np.sort(means)
    assert (result.low, result.high) == pytest.approx(
        (ordered[samples // 40], ordered[samples - samples // 40 - 1]), abs=1e-4
    )
    with pytest.raises(ValueError, match="1 baseline and 2 system hypothesis sets"):
        pooled_paired_bootstrap([seeds[0][0]], [seeds[0][1], seeds[1][1]], references)


def test_t_quantiles_are_the_tables() -> None:
    """Student t's 0.975 quantiles from a printed table (df = 1, 2, 4, 40, 120)."""
    expected = {1: 12.706, 2: 4.303, 4: 2.776, 40: 2.021, 120: 1.980}
    for df, t in expected.items():
        assert t_quantile_975(df) == pytest.approx(t, abs=1e-3), df


# The headline's per-seed Δ against MHA (seeds 1234, 2, 3), from the committed
# docs/comparison_headline/comparison.csv of 25fe9c2 ("paired Δ").
HEADLINE_DELTAS = {
    "gqa 8/4": [-1.5213080177332117, -0.4640743246233896, -0.34126974412811606],
    "gqa 8/2": [-1.0610704802474729, -0.3855217341771322, -0.9895869418775476],
    "mqa": [-2.4674224994795715, -1.5833575135211824, -1.719342080543118],
    "mla r16": [-5.442461592836574, -4.3248783987308475, -5.168063377597603],
    "mla r32": [-3.612759683193552, -1.7741118694827591, -3.5873736554048854],
}


def t_two_sided(t: float, df: int) -> float:
    """P(|T| > |t|) for Student's t, by Abramowitz and Stegun 26.7.3/26.7.4 (integer df)."""
    theta = math.atan(abs(t) / math.sqrt(df))
    c, s = math.cos(theta), math.sin(theta)
    if df % 2:  # odd: (2/π)(θ + sinθ (cosθ + 2/3 cos³θ + ... ))
        series, term = 0.0, c
        for k in range(1, (df - 1) // 2 + 1):
            series += term
            term *= c * c * (2 * k) / (2 * k + 1)
        inside = 2 / math.pi * (theta + s * series) if df > 1 else 2 * theta / math.pi
    else:  # even: sinθ (1 + 1/2 cos²θ + 1·3/(2·4) cos⁴θ + ...)
        series, term = 0.0, 1.0
        for k in range(1, df // 2 + 1):
            series += term
            term *= c * c * (2 * k - 1) / (2 * k)
        inside = s * series
    return 1 - inside


def test_paired_t_and_holm_give_the_headline_numbers() -> None:
    """The paired t-test's p of each design's Δ over the three seeds, Holm-adjusted over the
    five designs: the numbers issue 57 computed on its own (0.174, 0.126, 0.079, 0.023,
    0.117); unadjusted, GQA 8/2's p is the issue's 0.063."""
    p = [t_test_p(d) for d in HEADLINE_DELTAS.values()]
    for values, found in zip(HEADLINE_DELTAS.values(), p, strict=True):
        t = statistics.fmean(values) / (statistics.stdev(values) / math.sqrt(3))
        assert found == pytest.approx(t_two_sided(t, 2), abs=1e-12)
    assert round(p[1], 3) == 0.063
    assert [round(a, 3) for a in holm(p)] == [0.174, 0.126, 0.079, 0.023, 0.117]


@pytest.mark.parametrize("p", [[0.01, 0.04, 0.03, 0.005], [0.2, 0.01, 0.5], [0.9, 0.8]])
def test_holm_is_the_step_down_maximum(p: list[float]) -> None:
    """Holm's adjusted p of the i-th smallest: max over j <= i of (m - j + 1) p_(j), capped."""
    m, order = len(p), sorted(p)
    expected = [min(1.0, max((m - j) * order[j] for j in range(order.index(x) + 1))) for x in p]
    assert holm(p) == pytest.approx(expected)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_detectable_difference_is_found_with_80_percent_power(n: int) -> None:
    """Per-seed Δ drawn around the detectable difference: the two-sided t-test at 0.05
    rejects 80% of the time (200,000 simulated experiments)."""
    sd = 0.7
    shift = detectable_difference(sd, n)
    draws = np.random.default_rng(0).normal(shift, sd, size=(200_000, n))
    t = draws.mean(1) / (draws.std(1, ddof=1) / math.sqrt(n))
    assert np.mean(np.abs(t) > t_quantile_975(n - 1)) == pytest.approx(0.80, abs=0.005)


def test_tost_is_the_larger_one_sided_p() -> None:
    """TOST at margin 0.5: the larger of the two one-sided t-tests' p, each half the
    two-sided tail (written out above) on its side."""
    values, margin = [0.1, -0.2, 0.05, 0.15], 0.5
    se = statistics.stdev(values) / 2
    low, high = (statistics.fmean(values) + margin) / se, (statistics.fmean(values) - margin) / se
    # P(T > low) with low > 0 and P(T < high) with high < 0: each half a two-sided tail
    expected = max(t_two_sided(low, 3) / 2, t_two_sided(high, 3) / 2)
    assert tost_p(values, margin) == pytest.approx(expected, abs=1e-12)
    assert tost_p(values, margin) < 0.05  # equivalent within ±0.5
    assert tost_p(HEADLINE_DELTAS["gqa 8/2"], margin) > 0.05  # GQA 8/2 is not shown equal
    with pytest.raises(ValueError, match="equivalence_margin=0; expected a positive"):
        tost_p(values, 0)
    with pytest.raises(ValueError, match="n=1 seeds; the t-test needs at least 2"):
        detectable_difference(1.0, 1)


def test_bad_significance_input_is_one_clear_error(references, tmp_path: Path) -> None:
    root = tmp_path / "runs"
    write_run(root, "mha", "mha", 4, 1, references, "hypotheses.test.txt")
    write_run(root, "gqa", "gqa", 2, 1, references[:-1], "hypotheses.test.txt")
    ref_file = tmp_path / "ref.de"
    ref_file.write_text("".join(f"{line}\n" for line in references))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=rf"gqa/hypotheses.test.txt: {N - 1} lines for {N} ref"):
        compare(out, runs=root, references=str(ref_file), significance={"lang": "de"})
    with pytest.raises(FileNotFoundError, match="references=nope.txt: no such file"):
        compare(out, runs=root, references="nope.txt")
    with pytest.raises(ValueError, match="references=null reads the test split named in"):
        compare(out, runs=root)
    with pytest.raises(ValueError, match="significance.test='t'; expected one of bs, ar"):
        compare(out, runs=root, significance={"test": "t"})
    with pytest.raises(ValueError, match="significance.metric='chrf'; expected one of lc-tok"):
        compare(out, runs=root, significance={"metric": "chrf"})
    with pytest.raises(ValueError, match="significance.samples=-1; expected >= 0"):
        compare(out, runs=root, significance={"samples": -1})
    assert not out.exists()


@pytest.mark.slow  # 2 processes; compare.py: test_compare.py
def test_script_takes_the_significance_options(references, tmp_path: Path) -> None:
    root = tmp_path / "runs"
    write_run(root, "mha", "mha", 4, 1, system(references, 3, 0), "eval/hyp.txt")
    write_run(root, "gqa", "gqa", 2, 1, system(references, 2, 1), "eval/hyp.txt")
    ref_file = tmp_path / "ref.de"
    ref_file.write_text("".join(f"{line}\n" for line in references))
    out = tmp_path / "out"
    result = run_script(
        "compare.py",
        f"runs={root}",
        f"out={out}",
        "hypotheses=eval/hyp.txt",
        f"references={ref_file}",
        "significance.test=ar",
        "significance.samples=300",
        "significance.metric=sacrebleu",
    )
    assert result.returncode == 0, result.stderr
    md = (out / "comparison.md").read_text()
    assert "BLEU here is **sacrebleu**" in md
    assert "paired approximate randomization (300 trials, SACREBLEU_SEED 12345" in md
    bad = run_script("compare.py", f"runs={root}", f"out={out}", "significance.test=t")
    assert_one_error_line(bad, "significance.test='t'; expected one of bs, ar")


def test_references_default_to_the_test_split_the_runs_name(
    references, multi30k_dir: Path, tmp_path: Path
) -> None:
    """Without references=, the runs' saved data settings (.hydra/config.yaml) name the test
    split and the language of lc-tok: the same results as with those references given."""
    root = tmp_path / "runs"
    write_run(root, "mha", "mha", 4, 1, system(references, 3, 0), "hypotheses.test.txt")
    write_run(root, "gqa", "gqa", 2, 1, system(references, 2, 1), "hypotheses.test.txt")
    for job in ("mha", "gqa"):
        (root / job / ".hydra" / "config.yaml").write_text(
            f"seed: 1\ndata:\n  name: bentrevett/multi30k\n  src_lang: en\n  tgt_lang: de\n"
            f"  local_dir: {multi30k_dir}\n  test_limit: {N}\n  cache_dir: ${{paths.cache_dir}}\n"
        )
    ref_file = tmp_path / "ref.de"
    ref_file.write_text("".join(f"{line}\n" for line in references))
    tables, notes = [], []
    for options in ({}, {"references": str(ref_file), "significance": {"lang": "de"}}):
        compare(tmp_path / "out", runs=root, **options)
        tables.append((tmp_path / "out" / "comparison.csv").read_text())
        notes.append((tmp_path / "out" / "comparison.md").read_text())
    assert tables[0] == tables[1]
    assert f"against {N} references (the test split of bentrevett/multi30k en-de)" in notes[0]
    assert f"against {N} references ({ref_file})" in notes[1]
