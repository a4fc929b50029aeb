"""The long-context comparison from run records: differences against MHA paired by seed,
tested over seeds (the t-test and Holm of the translation comparison), the speed rows of
the checkpoint benchmark beside them, the files written; mixing translation runs with LM
runs, or two runs of one design and seed, refused by name. The declared family of tests
(Holm over it, a test added after it exploratory), the learning-rate grid, the order at the
last two evaluations, and runs that cannot be pooled (no saved config, another thread
count) refused by name."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from multihead.analysis.comparison import compare
from multihead.analysis.plots import pareto_setting
from multihead.analysis.tested import SeedTest

LOSSES = {  # design -> seed -> (val/loss, val/loss@0-63, val/loss@64-127)
    "mha": {1: (2.00, 2.50, 1.80), 2: (2.10, 2.55, 1.90), 3: (2.05, 2.52, 1.85)},
    "gqa": {1: (2.03, 2.50, 1.86), 2: (2.12, 2.56, 1.93), 3: (2.09, 2.53, 1.90)},
    "mqa": {1: (2.20, 2.60, 2.00), 2: (2.31, 2.66, 2.12), 3: (2.26, 2.62, 2.07)},
}
CACHE = {"mha": 4096, "gqa": 1024, "mqa": 512}


def write_run(
    root: Path, design: str, seed: int, summary: dict, lr: float = 3e-3, steps: int = 3
) -> Path:
    run = root / f"{design}_s{seed}"
    run.mkdir(parents=True)
    base = {"kind": design, "run_name": f"lm-{design}8-rope_sdpa", "seed": seed, "steps": 3,
            "params/total": 1000, "params/attention": 100, "run/threads": 1,
            "kv_cache/bytes_per_token": CACHE[design]}  # fmt: skip
    (run / "summary.json").write_text(json.dumps({**base, **summary}))
    (run / ".hydra").mkdir()
    config = f"seed: {seed}\nmodule:\n  optimizer:\n    lr: {lr}\ntrainer:\n  max_steps: {steps}\n"
    (run / ".hydra" / "config.yaml").write_text(config)
    return run


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
        "equal_terms.csv",
        "learning_curves.csv",
        "tests.csv",
        "learning_curves_lm.png",
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
    assert "Held-out loss by source package" not in text  # these runs logged none
    csv_lines = paths[1].read_text().splitlines()
    assert len(csv_lines) == 1 + 9 and csv_lines[0].startswith("task,design,seed,val/loss")


def test_translation_runs_and_repeated_seeds_are_refused(lm_runs, tmp_path):
    (lm_runs / "translation").mkdir()
    (lm_runs / "translation" / "summary.json").write_text(json.dumps({"val/bleu": 20.0, "seed": 1}))
    with pytest.raises(ValueError, match="9 of the 10 runs are decoder-only LM or MQAR runs"):
        compare(tmp_path / "out", runs=lm_runs)
    shutil.rmtree(lm_runs / "translation")
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


def family_file(path: Path, tests: str, declared: str = "2026-01-01T00:00:00+00:00") -> Path:
    path.write_text(f"declared: '{declared}'\ncommit: abc1234\ntests:\n{tests}")
    return path


FAMILY = """\
  - task: lm
    baseline: lm-mha8-rope_sdpa
    designs: [lm-gqa8-rope_sdpa, lm-mqa8-rope_sdpa]
    metrics: [val/loss, val/loss@64-127]
  - task: lm
    baseline: lm-mha8-rope_sdpa
    designs: [lm-mla8-rope_sdpa]
    metrics: [val/loss]
"""


def section(text: str, title: str) -> str:
    return text.split(title)[1].split("\n## ")[0].split("\n### ")[0]


def test_holm_runs_over_the_declared_family_and_a_setting_added_after_is_exploratory(
    lm_runs, tmp_path
):
    """Five declared tests (four with runs, MLA's without: p = 1 in the family): Holm over
    all five, checked against the project's Holm on the same p's, written out here. The
    bucket at 0-63 is in no entry: exploratory, its p unadjusted. Then the 0-63 bucket is
    added to the file after the declaration (added:): still exploratory."""
    family = family_file(tmp_path / "family.yaml", FAMILY)
    _, paths = compare(tmp_path / "out", runs=lm_runs, family=family)
    text = paths[0].read_text()
    held = section(text, "## The family of tests")
    assert "whole family of 5 tests declared in" in held
    assert "1 declared tests have no runs yet (each counts as p = 1): lm lm-mla8-rope_sdpa" in held
    rows = {
        (cells[2], cells[4]): cells
        for line in held.splitlines()
        if line.startswith("| lm |")
        for cells in [[c.strip() for c in line.split("|")]]
    }
    # The paired t-test's p of each tested pair, from the report; Holm by hand over them
    # and MLA's 1: the i-th smallest of m = 5 times (m - i), the running maximum, capped.
    tested = [("gqa", "val/loss"), ("mqa", "val/loss"), ("gqa", "val/loss@64-127"),
              ("mqa", "val/loss@64-127")]  # fmt: skip
    raw = sorted([float(rows[k][6]) for k in tested] + [1.0])
    steps = [min(1.0, (5 - i) * p) for i, p in enumerate(raw)]
    by_hand = {p: max(steps[: i + 1]) for i, p in enumerate(raw)}
    for k in tested:
        assert abs(float(rows[k][7]) - by_hand[float(rows[k][6])]) < 1.5e-3, (k, rows[k])
    explore = section(text, "### Exploratory tests")
    assert "| lm | gqa | mha | val/loss@0-63 |" in explore
    assert "exploratory (unadjusted p" in explore
    added = (
        FAMILY
        + """\
  - task: lm
    baseline: lm-mha8-rope_sdpa
    designs: [lm-gqa8-rope_sdpa]
    metrics: [val/loss@0-63]
    added: '2026-02-01T00:00:00+00:00'
"""
    )
    family_file(family, added)
    _, paths = compare(tmp_path / "out", runs=lm_runs, family=family)
    text = paths[0].read_text()
    assert "| lm | gqa | mha | val/loss@0-63 |" in section(text, "### Exploratory tests")
    assert "whole family of 5 tests" in text
    family.write_text("declared: 2026-01-01\ntests: []\n")
    with pytest.raises(ValueError, match=r"declared='2026-01-01'|declared=datetime.date"):
        compare(tmp_path / "out", runs=lm_runs, family=family)


def test_a_run_without_a_saved_config_is_refused_by_its_directory(lm_runs, tmp_path):
    """hydra.output_subdir=null: no .hydra/config.yaml, nothing to check pooling against."""
    shutil.rmtree(lm_runs / "gqa_s2" / ".hydra")
    with pytest.raises(ValueError) as error:
        compare(tmp_path / "out", runs=lm_runs)
    message = str(error.value)
    assert message.startswith(f"{lm_runs / 'gqa_s2'}: no saved config") and "\n" not in message
    assert not (tmp_path / "out").exists()


def test_seeds_on_other_thread_counts_are_pooled_only_when_the_user_says(lm_runs, tmp_path):
    path = lm_runs / "mqa_s3" / "summary.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"run/threads": 2}))
    with pytest.raises(ValueError, match=r"pooled as seeds of 'lm-mqa8-rope_sdpa' but ran on "
                       r"threads 1 and 2 \(run/threads\)"):  # fmt: skip
        compare(tmp_path / "out", runs=lm_runs)
    _, paths = compare(tmp_path / "out", runs=lm_runs, pool_despite=["threads"])
    assert "pooled although their configs differ in threads (pool_despite" in paths[0].read_text()


@pytest.mark.slow  # 7 s of CPU
def test_the_grid_chooses_each_design_s_rate_on_its_selection_figure(lm_runs, tmp_path):
    """GQA also at two more rates: the rate with the lowest mean select/loss is chosen (here
    1e-3, inside the grid), and the tests read only its runs; a best rate at the edge says
    so. Runs of one rate lacking the figure are refused by name."""
    for run_dir in lm_runs.iterdir():
        path = run_dir / "summary.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | {"select/loss": 2.5}))
    for lr, select in ((1e-3, 2.0), (3e-4, 2.2)):
        for seed in (1, 2, 3):
            write_run(lm_runs / f"lr{lr}", "gqa", seed, {
                "val/loss": 9.0, "val/loss@0-63": 9.0, "val/loss@64-127": 9.0,
                "select/loss": select}, lr=lr)  # fmt: skip
    _, paths = compare(tmp_path / "out", runs=lm_runs)
    grid = section(paths[0].read_text(), "## Learning rates")
    assert "| gqa | 0.001 | 3 | select/loss | 2.0000 | **chosen** |" in grid
    assert "| gqa | 0.003 | 3 | select/loss | 2.5000 |  |" in grid
    assert "| mha | 0.003 | 3 | select/loss | 2.5000 | one grid point" in grid
    # the chosen rate's runs (val/loss 9.0) are what the tests read: Δ 7.00, 6.90, 6.95
    assert "+7.0000, +6.9000, +6.9500" in paths[0].read_text()
    for seed in (1, 2, 3):  # now the best is the smallest rate: the grid's edge
        path = lm_runs / "lr0.0003" / f"gqa_s{seed}" / "summary.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | {"select/loss": 1.0}))
    _, paths = compare(tmp_path / "out", runs=lm_runs)
    assert "(at the grid's edge: extend the grid)" in paths[0].read_text()
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items()
                                if k != "select/loss"}))  # fmt: skip
    with pytest.raises(ValueError, match=r"those at 0.0003 have no select/loss to choose by"):
        compare(tmp_path / "out", runs=lm_runs)
    with pytest.raises(ValueError, match=r"^grid=\{'lmm': 'select/loss'\}: expected the figure"):
        compare(tmp_path / "out", runs=lm_runs, grid={"lmm": "select/loss"})


def test_seeds_run_after_the_choice_do_not_vote_in_the_grid(lm_runs, tmp_path):
    """MHA's grid ran at seed 1: 3e-3 (select/loss 2.5) beats 1e-3 (2.6). Its seeds 2 and 3
    then ran at the chosen 3e-3 and came out worse (3.0): over all its runs 3e-3 averages
    2.667, behind 1e-3's one seed, but the rates are compared at the seed both ran, so 3e-3
    stays chosen and all three of its seeds enter the tests. Rates that share no seed are
    refused by name."""
    for seed, select in ((1, 2.5), (2, 3.0), (3, 3.0)):
        path = lm_runs / f"mha_s{seed}" / "summary.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | {"select/loss": select}))
    worse = {"val/loss": 9.0, "val/loss@0-63": 9.0, "val/loss@64-127": 9.0}
    write_run(lm_runs / "lr1e-3", "mha", 1, worse | {"select/loss": 2.6}, lr=1e-3)
    _, paths = compare(tmp_path / "out", runs=lm_runs)
    text = paths[0].read_text()
    grid = section(text, "## Learning rates")
    assert "| mha | 0.001 | 1 | select/loss | 2.6000 |  |" in grid
    assert "| mha | 0.003 | 1 of 3 | select/loss | 2.5000 | **chosen**" in grid
    assert "| mha | 3 | 2.0500 ± 0.0500 |" in text  # the tests read 3e-3's three seeds
    write_run(lm_runs / "lr1e-4", "mha", 7, worse | {"select/loss": 2.0}, lr=1e-4)
    with pytest.raises(ValueError, match=r"^lm-mha8-rope_sdpa: the learning rates of its grid "
                                         r"share no seed \(0.0001: \[7\]; 0.001: \[1\]; "
                                         r"0.003: \[1, 2, 3\]\)"):  # fmt: skip
        compare(tmp_path / "out", runs=lm_runs)


def test_a_verdict_is_stated_only_where_the_order_stopped_moving(lm_runs, tmp_path):
    """MQA is above MHA at the last evaluation but was below it at the one before (its
    curve crossed): its verdict says it is still moving; GQA's order held. The final
    evaluation 3 steps after the last validation (the LM's 797 and 800) is the same point
    of training, not a second one: it replaces the evaluation at 200, so the order is read
    at 100 and 203, where MQA crossed."""
    curves = {  # design: (loss at step 100, at step 200) for every seed
        "mha": (3.0, 2.0), "gqa": (3.1, 2.05), "mqa": (2.9, 2.2),
    }  # fmt: skip
    for design, (early, late) in curves.items():
        for seed in (1, 2, 3):
            rows = "step,val/loss\n" + f"100,{early}\n200,{late}\n203,{late - 0.001}\n"
            (lm_runs / f"{design}_s{seed}" / "csv").mkdir()
            (lm_runs / f"{design}_s{seed}" / "csv" / "metrics.csv").write_text(rows)
    _, paths = compare(tmp_path / "out", runs=lm_runs)
    overall = paths[0].read_text().split("**val/loss**")[-1].split("**val/loss@")[0]
    mqa = next(line for line in overall.splitlines() if line.startswith("| mqa"))
    gqa = next(line for line in overall.splitlines() if line.startswith("| gqa"))
    assert mqa.endswith("| still moving: about learning speed at this budget |")
    assert not gqa.endswith("still moving: about learning speed at this budget |")


@pytest.mark.parametrize(
    ("mean", "last_two", "longer", "moving", "flips"),
    [
        (0.0, (0.0, 0.0), (6, 0.0, 1, 0.0), False, False),  # tied throughout: held
        (-0.4, (0.0, -0.4), None, True, False),  # a lead below that appears at the last one
        (-0.4, (-0.4, 0.0), None, True, False),  # and one that vanishes there
        (-0.4, (-0.3, -0.4), (6, 0.0, 1, -0.3), False, True),  # a lead below that longer ties
        (0.0, (0.0, 0.0), (6, -0.3, 1, 0.0), False, True),  # a tie that longer breaks
    ],
)
def test_a_tie_is_an_order_of_its_own(mean, last_two, longer, moving, flips):
    """Two MQAR runs both at 100% tie: a tie is neither design ahead, so a lead that
    appears or vanishes is a change of order, and two ties are not."""
    test = SeedTest((mean, mean), None, 0.5, 0.5, None, None, None,
                    last_two=last_two, longer=longer)  # fmt: skip
    assert (test.moving, test.flips) == (moving, flips)


@pytest.mark.parametrize(
    ("same_seeds", "longer", "verdict"),
    [
        (-0.3, -0.2, "no detectable difference"),  # below throughout: held
        (0.1, 0.1, "the order flips at 6 steps: about"),  # against the mean's order
        (0.1, -0.2, "the order flips at 6 steps for the seed trained longer: about"),
        (-0.3, 0.0, "the difference vanishes at 6 steps: about"),
        (0.0, -0.2, "a difference appears at 6 steps for the seed trained longer: about"),
    ],
)
def test_a_longer_run_is_read_against_the_verdict_and_against_its_own_seed(
    same_seeds, longer, verdict
):
    """The mean over seeds is below (−0.4) and one seed was trained longer: the order must
    hold there against the verdict's, and against that seed's own at the compared budget,
    where the budget is all that changed; a seed that was above and falls below with the
    budget says the order was still moving, even where it lands on the verdict's side."""
    test = SeedTest((-0.5, -0.3), None, 0.5, 0.5, None, None, None,
                    last_two=(-0.4, -0.4), longer=(6, longer, 1, same_seeds))  # fmt: skip
    assert test.verdict.startswith(verdict)


@pytest.mark.parametrize(
    ("last_two", "longer", "verdict"),
    [
        # MQAR's narrow-score MLA against MLA: the sign changes inside the margin
        ((-0.0177, -0.0067), (3000, 0.0003, 1, -0.01), "equivalent within ±0.02"),
        ((0.005, -0.005), None, "equivalent within ±0.02"),
        ((-0.03, -0.0067), None, "outside ±0.02 at the end of training or trained longer"),
        (
            (-0.01, -0.0067),
            (3000, 0.05, 1, -0.01),
            "outside ±0.02 at the end of training or trained longer",
        ),
    ],
)
def test_an_equivalence_is_a_size_so_it_holds_where_the_ends_stay_within_the_margin(
    last_two, longer, verdict
):
    """TOST shows the difference within ±0.02 and Holm finds none: the verdict claims a
    size, not an order, so a sign that changes at the end of training or trained longer
    does not undo it; a difference there outside the margin does."""
    test = SeedTest((-0.006, -0.008), None, 0.2, 0.7, None, 0.01, 0.02,
                    last_two=last_two, longer=longer)  # fmt: skip
    assert test.verdict.startswith(verdict)


def test_an_order_that_flips_when_trained_longer_is_about_learning_speed(lm_runs, tmp_path):
    """The designs trained twice as long at seed 1: MQA's loss there is below MHA's, the
    other way round from the compared budget, so its verdict says the order flips; GQA's
    holds, with its difference there (1.85 - 1.80) beside it. A longer run at another rate,
    or at no longer budget, is refused by its directory; a missing directory by its name."""
    longer = tmp_path / "longer"
    for design, loss in (("mha", 1.80), ("gqa", 1.85), ("mqa", 1.75)):
        write_run(longer, design, 1, {"val/loss": loss, "val/loss@0-63": 2.3,
                                      "val/loss@64-127": 1.6}, steps=6)  # fmt: skip
    family = family_file(tmp_path / "family.yaml", FAMILY)
    _, paths = compare(tmp_path / "out", runs=lm_runs, family=family, longer=longer)
    held = section(paths[0].read_text(), "## The family of tests")
    assert "| Δ of the same seeds → trained longer (steps) | verdict |" in held
    rows = {line.split("|")[2].strip(): line for line in held.splitlines()
            if line.startswith("| lm |") and "| val/loss |" in line}  # fmt: skip
    assert rows["mqa"].endswith(
        "| the order flips at 6 steps: about learning speed at this budget |"
    )
    # seed 1 at the compared budget, by hand from LOSSES: 2.03 - 2.00
    assert "| +0.0300 → +0.0500 at 6 (1 seed) | no detectable difference |" in rows["gqa"]
    with (tmp_path / "out" / "tests.csv").open() as f:
        found = {(r["design"], r["figure"]): r for r in csv.DictReader(f)}
    assert found["lm-gqa8-rope_sdpa", "val/loss"]["longer budget (steps)"] == "6"
    with pytest.raises(FileNotFoundError, match=r"^longer=\S+nowhere: no such directory"):
        compare(tmp_path / "out", runs=lm_runs, longer=tmp_path / "nowhere")
    shutil.rmtree(longer / "gqa_s1")
    write_run(longer, "gqa", 1, {"val/loss": 1.85, "val/loss@0-63": 2.3}, lr=1e-2, steps=6)
    with pytest.raises(ValueError, match=r"gqa_s1: a longer run of 'lm-gqa8-rope_sdpa' whose "
                       r"config differs from the compared runs' in module.optimizer.lr \(0.003 "
                       r"against 0.01\)"):  # fmt: skip
        compare(tmp_path / "out", runs=lm_runs, longer=longer)
    shutil.rmtree(longer / "gqa_s1")
    write_run(longer, "gqa", 9, {"val/loss": 1.85, "val/loss@0-63": 2.3}, steps=6)
    unpaired = r"gqa_s9: a longer run of 'lm-gqa8-rope_sdpa' with seed 9, which its compared "
    with pytest.raises(ValueError, match=unpaired + r"runs do not have \(seeds \[1, 2, 3\]\)"):
        compare(tmp_path / "out", runs=lm_runs, longer=longer)
    shutil.rmtree(longer / "gqa_s9")
    write_run(longer, "gqa", 1, {"val/loss": 1.85, "val/loss@0-63": 2.3}, steps=3)
    with pytest.raises(ValueError, match=r"trainer.max_steps=3, where the compared runs of "
                       r"'lm-gqa8-rope_sdpa' train 3 steps; expected a longer budget"):  # fmt: skip
        compare(tmp_path / "out", runs=lm_runs, longer=longer)


@pytest.mark.slow  # 5 s of CPU
def test_wandb_true_logs_the_equal_terms_curves_and_tests(lm_runs, tmp_path, monkeypatch):
    """Offline: the long-context comparison's wandb run holds its tables (the runs, the
    equal terms, every run's curve points, every test) as the CSVs beside the report."""
    import csv

    for design in LOSSES:
        for seed in (1, 2, 3):
            rows = "step,val/loss\n10,3.0\n20,2.5\n"
            (lm_runs / f"{design}_s{seed}" / "csv").mkdir()
            (lm_runs / f"{design}_s{seed}" / "csv" / "metrics.csv").write_text(rows)
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "out"
    compare(out, runs=lm_runs, wandb_log=True, wandb_group="lc")
    (files,) = (out / "wandb").glob("offline-run-*/files")
    counts = {}
    for name in ("long_context", "equal_terms", "learning_curves", "tests"):
        (table_file,) = (files / "media" / "table").glob(f"{name}_*.table.json")
        table = json.loads(table_file.read_text())
        with open(out / f"{name}.csv", newline="") as f:
            header, *rows = list(csv.reader(f))
        assert table["columns"] == header and len(table["data"]) == len(rows)
        counts[name] = len(rows)
    # nine runs, one curve of two evaluations each; three designs described; two designs
    # against MHA on three figures
    assert (counts["learning_curves"], counts["equal_terms"], counts["tests"]) == (18, 3, 6)


@pytest.mark.slow  # 10 s of CPU
def test_a_control_of_one_run_name_is_its_own_design_by_split_by(lm_runs, tmp_path):
    """A parameter-matched GQA (wider FFN) tags itself as GQA does: pooled with GQA it is
    refused; split_by=[model.ffn_dim] makes it a design of its own, which the family names
    by a glob, and which is tested against MHA as declared. GQA keeps its plain name: most
    runs of that name (three against two) hold its FFN."""
    for seed in (1, 2):
        run = write_run(lm_runs / "control", "gqa", seed, {
            "val/loss": 2.0, "val/loss@0-63": 2.5, "val/loss@64-127": 1.8})  # fmt: skip
        config = run / ".hydra" / "config.yaml"
        config.write_text(config.read_text() + "model:\n  ffn_dim: 608\n")
    with pytest.raises(ValueError, match=r"differ in model.ffn_dim \(608 against None\)"):
        compare(tmp_path / "out", runs=lm_runs)
    family = family_file(tmp_path / "family.yaml", """\
  - task: lm
    baseline: lm-mha8-rope_sdpa
    designs: ["lm-gqa8-rope_sdpa {model.ffn_dim=*}"]
    metrics: [val/loss]
""")  # fmt: skip
    _, paths = compare(tmp_path / "out", runs=lm_runs, split_by=["model.ffn_dim"],
                       family=family)  # fmt: skip
    held = section(paths[0].read_text(), "## The family of tests")
    assert "whole family of 1 tests" in held
    (row,) = [line for line in held.splitlines() if line.startswith("| lm |")]
    assert row.startswith("| lm | gqa (lm-gqa8-rope_sdpa {model.ffn_dim=608}) | mha | val/loss |")


def test_the_held_out_loss_of_each_package_is_reported(lm_runs, tmp_path):
    """Runs that log val/loss/NAME per source package: each design's mean over its seeds,
    here MHA's sympy loss (2.0, 2.1, 2.3) at 2.1333."""
    for design in LOSSES:
        for seed, sympy in zip((1, 2, 3), (2.0, 2.1, 2.3), strict=True):
            path = lm_runs / f"{design}_s{seed}" / "summary.json"
            figures = {"val/loss/sympy": sympy, "val/loss/django": 3.0}
            path.write_text(json.dumps(json.loads(path.read_text()) | figures))
    _, paths = compare(tmp_path / "out", runs=lm_runs)
    text = paths[0].read_text()
    assert "| design | django | sympy |" in text
    assert "| mha | 3.0000 | 2.1333 |" in text
