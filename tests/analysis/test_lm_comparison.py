"""The long-context comparison from run records: differences against MHA paired by seed,
tested over seeds (the t-test and Holm of the translation comparison), the speed rows of
the checkpoint benchmark beside them, the files written; mixing translation runs with LM
runs, or two runs of one design and seed, refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from multihead.analysis.comparison import compare
from multihead.analysis.lm_comparison import pareto_setting

LOSSES = {  # design -> seed -> (val/loss, val/loss@0-63, val/loss@64-127)
    "mha": {1: (2.00, 2.50, 1.80), 2: (2.10, 2.55, 1.90), 3: (2.05, 2.52, 1.85)},
    "gqa": {1: (2.03, 2.50, 1.86), 2: (2.12, 2.56, 1.93), 3: (2.09, 2.53, 1.90)},
    "mqa": {1: (2.20, 2.60, 2.00), 2: (2.31, 2.66, 2.12), 3: (2.26, 2.62, 2.07)},
}
CACHE = {"mha": 4096, "gqa": 1024, "mqa": 512}


def write_run(root: Path, design: str, seed: int, summary: dict) -> None:
    run = root / f"{design}_s{seed}"
    run.mkdir(parents=True)
    base = {"kind": design, "run_name": f"lm-{design}8-rope_sdpa", "seed": seed, "steps": 3,
            "params/total": 1000, "params/attention": 100,
            "kv_cache/bytes_per_token": CACHE[design]}  # fmt: skip
    (run / "summary.json").write_text(json.dumps({**base, **summary}))


@pytest.fixture
def lm_runs(tmp_path):
    root = tmp_path / "runs"
    for design, seeds in LOSSES.items():
        for seed, (loss, early, late) in seeds.items():
            write_run(root, design, seed, {"val/loss": loss, "val/loss@0-63": early,
                                           "val/loss@64-127": late})  # fmt: skip
    return root


def test_each_design_is_tested_against_the_mha_run_of_its_seed(lm_runs, tmp_path):
    rows = [
        {"design": d, "candidate": "trained", "context": 128, "batch": 2, "ms": ms,
         "ms_min": ms * 0.9, "ms_max": ms * 1.2, "x_mha": 4.0 / ms, "x_mha_min": 1.0,
         "x_mha_max": 5.0, "cache_bytes": CACHE[d] * 2 * 130, "round_ms": [ms] * 3}
        for d, ms in (("mha", 4.0), ("gqa", 2.0), ("mqa", 1.0))
    ]  # fmt: skip
    speed = tmp_path / "speed.json"
    speed.write_text(json.dumps(rows))
    _, paths = compare(tmp_path / "out", runs=lm_runs, long_context=speed)
    assert [p.name for p in paths] == [
        "long_context.md",
        "long_context.csv",
        "long_context_pareto.png",
    ]
    text = paths[0].read_text()
    # GQA's per-seed differences of the late bucket, by hand: 0.06, 0.03, 0.05.
    assert "+0.0600, +0.0300, +0.0500" in text
    # MQA's overall loss: +0.20, +0.21, +0.21 against MHA, all three seeds above it.
    assert "+0.2000, +0.2100, +0.2100" in text
    section = text.split("**val/loss**")[1].split("**val/loss@")[0]
    mqa = next(line for line in section.splitlines() if line.startswith("| mqa"))
    assert mqa.endswith("| higher |")
    assert "| 128 x 2 | 1.00 (0.90-1.20) | 4.00 (1.00-5.00) |" in text
    # Context use by hand: MHA seed 1: 1 - 1.80 / 2.50 = 28.00%.
    assert "| mha | +28.00%, +25.49%, +26.59% |" in text
    csv_lines = paths[1].read_text().splitlines()
    assert len(csv_lines) == 1 + 9 and csv_lines[0].startswith("task,design,seed,val/loss")


def test_translation_runs_and_repeated_seeds_are_refused(lm_runs, tmp_path):
    (lm_runs / "translation").mkdir()
    (lm_runs / "translation" / "summary.json").write_text(json.dumps({"val/bleu": 20.0, "seed": 1}))
    with pytest.raises(ValueError, match="9 of the 10 runs are decoder-only LM or MQAR runs"):
        compare(tmp_path / "out", runs=lm_runs)
    (lm_runs / "translation" / "summary.json").unlink()
    (lm_runs / "translation").rmdir()
    write_run(lm_runs / "again", "gqa", 2, {"val/loss": 2.0, "val/loss@0-63": 2.0,
                                             "val/loss@64-127": 2.0})  # fmt: skip
    with pytest.raises(ValueError, match="two lm-gqa8-rope_sdpa runs with seed 2"):
        compare(tmp_path / "out", runs=lm_runs)


def test_pool_despite_names_a_key_no_lm_seeds_differ_in_and_is_refused(lm_runs, tmp_path):
    with pytest.raises(ValueError, match=r"^pool_despite names module.decay, but no seeds"):
        compare(tmp_path / "out", runs=lm_runs, pool_despite=["module.decay"])
    assert not (tmp_path / "out").exists()


def test_the_pareto_speed_is_read_where_the_most_tokens_are_cached_per_step():
    rows = [{"context": c, "batch": b, "ms": 1.0} for c, b in ((32768, 1), (8192, 8), (2048, 8))]
    assert pareto_setting(rows) == (8192, 8)  # 65,536 cached tokens a step against 32,768
    rows += [{"context": 16384, "batch": 4, "ms": 1.0}, {"context": 65536, "batch": 2}]
    assert pareto_setting(rows) == (16384, 4)  # a tie goes to the longer context; no ms: skipped
