"""scripts/compare.py: the runs table, ratios vs MHA, CSV, plots, curves and bad input."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from multihead.analysis import comparison
from multihead.analysis.comparison import OUTPUT_FILES, compare
from multihead.analysis.report import pareto_frontier
from multihead.analysis.runs import (
    RunResult,
    find_run_dirs,
    load_local_runs,
    load_wandb_group,
    read_metrics_csv,
)
from multihead.analysis.speed import BEAM_KEY, GREEDY_KEY, TRAIN_KEY

from helpers.scripts import run_script

METRICS_CSV = """\
epoch,lr-Adam,step,train/loss,val/bleu,val/loss
,1.1e-06,9,,,
0,,9,7.3,,
0,,19,,1.5,6.4
0,,39,,2.5,5.9
"""


def summary(kind: str, heads: int, kv: int, **figures) -> dict:
    name = f"{kind}-h{heads}-kv{kv}-sdpa"
    return {
        "run_name": name,
        "kind": kind,
        "num_heads": heads,
        "num_kv_heads": kv,
        "backend": "sdpa",
        "head_tag": name,
        "tag": f"{kind}{heads}" + (f"kv{kv}" if kind == "gqa" else ""),  # as a layer tags itself
        "heads/active_fraction": 1.0,
        "params/total": 70000 + 1000 * kv,
        "params/attention": 20000 + 1000 * kv,
        "kv_cache/bytes_per_token": 128 * kv,
        "perf/train_tgt_tokens_per_s": 30000.0,
        "perf/peak_memory_mb": 500.0,
        "decode/greedy_sentences_per_s": 400.0 / kv,
        "decode/beam5_sentences_per_s": 100.0 / kv,
        "val/bleu": 2.5,
        "test/bleu": 20.0 + kv,
        **figures,
    }


def keep_config(run_dir: Path, seed: int | None = None) -> None:
    """The config training saves in the run directory (a run without one is refused)."""
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    if not (run_dir / ".hydra" / "config.yaml").is_file():
        (run_dir / ".hydra" / "config.yaml").write_text(f"seed: {seed}\n")


def when(start: float, end: float, host: str = "node1") -> dict:
    """summary.json's run/start, run/end (hours after midnight) and run/host."""
    return {
        "run/start": f"2026-01-01T{int(start):02d}:{round(60 * (start % 1)):02d}:00+00:00",
        "run/end": f"2026-01-01T{int(end):02d}:{round(60 * (end % 1)):02d}:00+00:00",
        "run/host": host,
    }


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    """A multirun directory: MHA and GQA with csv logs, MQA without any curves."""
    root = tmp_path / "multiruns" / "2026-01-01_00-00-00"
    jobs = {
        "0": summary("gqa", 4, 2),
        "1": summary("mqa", 4, 1, **{"decode/beam5_sentences_per_s": None}),
        "2": summary("mha", 4, 4),
    }
    for hour, (job, figures) in enumerate(jobs.items()):
        figures |= when(hour, hour + 1)  # one after another: their own speeds are comparable
        (root / job).mkdir(parents=True)
        (root / job / "summary.json").write_text(json.dumps(figures))
        keep_config(root / job)
    for job in ("0", "2"):
        (root / job / "csv").mkdir()
        (root / job / "csv" / "metrics.csv").write_text(METRICS_CSV)
    (root / "3" / ".hydra").mkdir(parents=True)  # a crashed job: no summary.json, skipped
    return root


# The headline's per-seed Δ against MHA (seeds 1234, 2, 3: "paired Δ" of the committed
# docs/comparison_headline/comparison.csv of 25fe9c2): (run name, kind, KV-cache
# bytes/token, Δ per seed).
HEADLINE = [
    ("gqa84", "gqa", 2048, (-1.5213080177332117, -0.4640743246233896, -0.34126974412811606)),
    ("gqa82", "gqa", 1024, (-1.0610704802474729, -0.3855217341771322, -0.9895869418775476)),
    ("mqa", "mqa", 512, (-2.4674224994795715, -1.5833575135211824, -1.719342080543118)),
    ("mla16", "mla", 256, (-5.442461592836574, -4.3248783987308475, -5.168063377597603)),
    ("mla32", "mla", 512, (-3.612759683193552, -1.7741118694827591, -3.5873736554048854)),
]


@pytest.fixture
def headline_dir(tmp_path: Path) -> Path:
    """Three seeds of MHA (20.0 BLEU) and five designs at 20 + the headline's Δ, one after
    another on one machine."""
    root = tmp_path / "headline"
    designs = [("mha", "mha", 4096, (0.0, 0.0, 0.0)), *HEADLINE]
    hour = 0.0
    for name, kind, cache, deltas in designs:
        for seed, delta in zip((1, 2, 3), deltas, strict=True):
            figures = summary(kind, 8, 1, **when(hour, hour + 0.4), seed=seed)
            figures |= {"run_name": name, "kv_cache/bytes_per_token": cache}
            figures["test/bleu"] = 20.0 + delta
            (root / f"{name}_s{seed}").mkdir(parents=True)
            (root / f"{name}_s{seed}" / "summary.json").write_text(json.dumps(figures))
            keep_config(root / f"{name}_s{seed}", seed)
            hour += 0.5
    return root


def test_verdicts_over_seeds_are_holm_adjusted(headline_dir: Path, tmp_path: Path) -> None:
    """The headline's Δ: Holm's p beside the unadjusted p, and the verdict from Holm's
    (issue 57's 0.174, 0.126, 0.079, 0.023, 0.117): only MLA r=16 is lower. No design is
    within the 0.5 BLEU margin by TOST. MLA r=32 and MQA store the same cache: their
    contrast per seed is -1.15, -0.19, -1.87, t-interval [-3.16, +1.02], p 0.16 (0.159)."""
    compare(tmp_path / "out", runs=headline_dir, equivalence_margin=0.5)
    md = (tmp_path / "out" / "comparison.md").read_text()
    means = md.split("## Means over seeds")[1].split("## Designs of one KV-cache size")[0]
    assert (
        "| p (paired t) | p (Holm) | detectable (80% power, unadjusted α 0.05) | TOST p | verdict |"
        in means
    )
    assert "Holm's step-down adjustment over the designs tested against MHA" in means
    holm = {"gqa84": "0.174", "gqa82": "0.126", "mqa": "0.079", "mla16": "0.023"}
    holm["mla32"] = "0.117"
    for name, p in holm.items():
        (row,) = [line for line in means.splitlines() if line.startswith(f"| {name} |")]
        cells = row.split(" | ")
        assert cells[8] == p, row
        assert cells[11] == ("lower" if name == "mla16" else "no detectable difference"), row
        assert float(cells[10]) > 0.05  # TOST p: none is shown equal to MHA
    contrasts = md.split("## Designs of one KV-cache size against each other")[1]
    (row,) = [line for line in contrasts.splitlines() if line.startswith("| mqa | mla32 |")]
    assert row.startswith(
        "| mqa | mla32 | +1.07 | [-1.02, +3.16] | +1.15, +0.19, +1.87 | 0.159 | 0.159 |"
    )
    assert row.endswith("| no detectable difference |")


def test_runs_are_found_and_sorted_mha_gqa_mqa(runs_dir: Path) -> None:
    assert [p.name for p in find_run_dirs(runs_dir)] == ["0", "1", "2"]
    runs = load_local_runs(runs_dir)
    assert [r.label for r in runs] == ["mha-h4-kv4-sdpa", "gqa-h4-kv2-sdpa", "mqa-h4-kv1-sdpa"]
    assert [r.curve_source for r in runs] == ["csv", "csv", "none"]


def test_metrics_csv_curves_skip_empty_cells(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text(METRICS_CSV)
    assert read_metrics_csv(path) == {
        "val/bleu": [(19, 1.5), (39, 2.5)],
        "val/loss": [(19, 6.4), (39, 5.9)],
    }


def test_table_rows_values_and_ratios(runs_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    runs, paths = compare(out, runs=runs_dir)
    assert [p.name for p in paths] == list(OUTPUT_FILES)

    md = (out / "comparison.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert table[0].startswith(
        "| run | kind | heads tag | heads | heads active | kv heads | backend | params |"
    )
    assert table[0].endswith(
        "| test BLEU | train tgt tok/s (in training) | greedy sent/s (in training) "
        "| beam sent/s (in training) |"
    )
    assert table[1] == (
        "| mha-h4-kv4-sdpa | mha | mha4 | 4 | 1.00 | 4 | sdpa | 74,000 | 24,000 | 512 "
        "| 500 | 2.50 | 24.00 | 30,000 | 100.0 | 25.0 |"
    )
    assert table[3].startswith(
        "| mqa-h4-kv1-sdpa | mqa | mqa4 | 4 | 1.00 | 1 | sdpa | 71,000 | 21,000 | 128 |"
    )
    assert table[3].endswith("| 400.0 | – |")  # the missing beam speed
    assert "No two runs trained at the same time on one machine." in md
    # vs MHA: KV-cache ×, attention params ×, train tok/s ×, greedy ×, beam × (all measured
    # in training, by runs that did not overlap), test BLEU Δ
    assert "| greedy × (in training) |" in md
    assert "| gqa-h4-kv2-sdpa | mha-h4-kv4-sdpa | 0.50 | 0.92 | 1.00 | 2.00 | 2.00 | -2.00 |" in md
    assert "| mqa-h4-kv1-sdpa | mha-h4-kv4-sdpa | 0.25 | 0.88 | 1.00 | 4.00 | – | -3.00 |" in md
    for name in OUTPUT_FILES[2:]:
        assert f"]({name})" in md

    with open(out / "comparison.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == ["mha-h4-kv4-sdpa", "gqa-h4-kv2-sdpa", "mqa-h4-kv1-sdpa"]
    assert float(rows[2]["KV-cache ×"]) == 0.25 and rows[0]["KV-cache ×"] == ""
    assert rows[2]["beam sent/s (in training)"] == ""
    assert float(rows[2]["greedy sent/s (in training)"]) == 400.0

    for name in OUTPUT_FILES[2:]:
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


def test_rerun_overwrites_only_its_own_files(runs_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "comparison.md").write_text("old")
    compare(out, runs=runs_dir)
    assert (out / "notes.txt").read_text() == "keep me"
    assert (out / "comparison.md").read_text().startswith("# Run comparison")
    assert sorted(p.name for p in out.iterdir()) == sorted([*OUTPUT_FILES, "notes.txt"])


def test_duplicate_run_names_get_their_directory(runs_dir: Path) -> None:
    shutil.copytree(runs_dir / "2", runs_dir / "4")
    labels = [r.label for r in load_local_runs(runs_dir)]
    assert labels[:2] == ["mha-h4-kv4-sdpa [2]", "mha-h4-kv4-sdpa [4]"]


def test_empty_or_missing_runs_dir_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"runs={tmp_path}: no summary.json found"):
        compare(tmp_path / "out", runs=tmp_path)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        compare(tmp_path / "out", runs=tmp_path / "nope")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="exactly one of runs=PATH or group=NAME"):
        compare(tmp_path / "out")


@pytest.mark.parametrize(
    ("switch", "message"),
    [({"speed": "no"}, "speed must be a bool, got 'no'"),
     ({"wandb_log": "off"}, "wandb must be a bool, got 'off'")],
)  # fmt: skip
def test_a_switch_takes_a_bool_only(tmp_path: Path, switch, message) -> None:
    """speed="no" measured the speed, a truthy string (issue 84)."""
    with pytest.raises(ValueError, match=f"^{message}$"):
        compare(tmp_path / "out", runs=tmp_path, **switch)
    assert not (tmp_path / "out").exists()


def test_wandb_group_offline_is_an_error(monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    with pytest.raises(ValueError, match="group=sweep1 reads runs from the wandb API"):
        load_wandb_group("sweep1", "multihead")


def test_script_writes_the_comparison(runs_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    result = run_script("compare.py", f"runs={runs_dir}", f"out={out}")
    assert result.returncode == 0, result.stderr
    assert "compared 3 runs" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(OUTPUT_FILES)


def test_pareto_frontier_of_bleu_against_cache_and_speed() -> None:
    """Written out: a run is on the frontier when no run is at least as good on the axis
    and better in BLEU."""
    figures = {  # name: (KV bytes per token, greedy sentences/s, test BLEU)
        "mha": (512, 100.0, 30.0),
        "gqa": (256, 110.0, 29.5),
        "mqa": (128, 120.0, 28.0),
        "mla-r32": (128, 90.0, 29.0),  # MQA's cache, better BLEU: MQA leaves the frontier
        "mla-r16": (64, 80.0, 27.0),
        "worse": (512, 50.0, 25.0),
    }
    runs = [
        RunResult(
            source=name,
            label=name,
            summary={
                "kv_cache/bytes_per_token": kv,
                "decode/greedy_sentences_per_s": speed,
                "test/bleu": bleu,
            },
        )
        for name, (kv, speed, bleu) in figures.items()
    ]
    by_cache = pareto_frontier(runs, "kv_cache/bytes_per_token", lower_is_better=True)
    assert [r.label for r in by_cache] == ["mla-r16", "mla-r32", "gqa", "mha"]
    by_speed = pareto_frontier(runs, "decode/greedy_sentences_per_s", lower_is_better=False)
    assert [r.label for r in by_speed] == ["mqa", "gqa", "mha"]


def test_seeds_pair_with_mha_of_their_own_seed(tmp_path: Path) -> None:
    """Two seeds of MHA and GQA: Δ pairs each GQA run with the MHA run of its seed, and the
    seed means (the table and the frontier) are worked out by hand here."""
    root = tmp_path / "runs"
    jobs = {  # directory: (kind, K/V heads, seed, test BLEU)
        "mha_s1": ("mha", 4, 1, 30.0),
        "mha_s2": ("mha", 4, 2, 28.0),
        "gqa_s1": ("gqa", 2, 1, 29.5),
        "gqa_s2": ("gqa", 2, 2, 28.5),
    }
    for hour, (job, (kind, kv, seed, bleu)) in enumerate(jobs.items()):
        (root / job).mkdir(parents=True)
        figures = summary(kind, 4, kv, **{"test/bleu": bleu}, **when(hour, hour + 1))
        if job == "gqa_s2":  # a run from before summary.json held the seed: Hydra's config
            (root / job / ".hydra").mkdir()
            (root / job / ".hydra" / "config.yaml").write_text(f"seed: {seed}\n")
        else:
            figures["seed"] = seed
            keep_config(root / job, seed)
        (root / job / "summary.json").write_text(json.dumps(figures))
    out = tmp_path / "out"
    runs, _ = compare(out, runs=root)
    assert [r.seed for r in runs] == [1, 2, 1, 2]
    md = (out / "comparison.md").read_text()
    # Per run: each GQA seed against its own MHA seed (-0.5 and +0.5), not both against seed 1.
    assert "| gqa-h4-kv2-sdpa [gqa_s1] | mha-h4-kv4-sdpa [mha_s1] |" in md
    assert "| gqa-h4-kv2-sdpa [gqa_s2] | mha-h4-kv4-sdpa [mha_s2] |" in md
    means = md.split("## Means over seeds")[1]
    assert "| mha-h4-kv4-sdpa | 2 | 29.00 | 28.00–30.00 |" + " – |" * 8 + " 512 |" in means
    # Δ -0.5 and +0.5: mean 0, standard deviation sqrt(0.5), t(0.975, 1 df) = 12.706, so
    # the interval is 0 ± 12.706 * sqrt(0.5) / sqrt(2) = ±6.35; t = 0, so p = 1, and Holm's
    # p over a family of one is p. Detectable (test_significance checks the function): ±8.17. No
    # margin was given, so no TOST. Then KV-cache bytes, params, and the speeds (in
    # training: the runs did not overlap).
    assert (
        "| gqa-h4-kv2-sdpa | 2 | 29.00 | 28.50–29.50 | +0.00 | [-6.35, +6.35] | -0.50, +0.50 "
        "| 1.000 | 1.000 | ±8.17 | – | no detectable difference | 256 | 72,000 | 30,000 | 200.0 "
        "| 50.0 |"
    ) in means
    assert "| params | train tgt tok/s (in training) | greedy sent/s (in training) |" in means
    # On the means, GQA ties MHA's BLEU with half the cache: MHA leaves the cache frontier.
    assert "- KV-cache bytes per token (fewer is better): gqa-h4-kv2-sdpa (2 runs)\n" in md


@pytest.mark.parametrize(
    "times, status",
    [
        ({"0": when(0, 2), "1": when(1, 3), "2": when(4, 5)}, "overlap"),
        ({"0": when(0, 2), "1": when(1, 3, host="node2"), "2": when(4, 5)}, "no overlap"),
        ({"0": when(0, 1), "1": {}, "2": when(4, 5)}, "unknown"),
    ],
)
def test_speeds_of_overlapping_runs_stay_out_of_ratios_and_plots(
    runs_dir: Path, tmp_path: Path, monkeypatch, times: dict, status: str
) -> None:
    """Runs 0 and 1 train at the same time on one host (overlap), on two hosts (no overlap),
    or run 1 does not say when (unknown): only without overlap do the plots, frontiers and
    ratios use the speeds the runs measured during training."""
    for job, figures in times.items():
        path = runs_dir / job / "summary.json"
        summary = {k: v for k, v in json.loads(path.read_text()).items() if "run/" not in k}
        path.write_text(json.dumps(summary | figures))
    panels = {}
    monkeypatch.setattr(
        comparison,
        "plot_bleu_against",
        lambda runs, path, plotted, *_: panels.update({path.name: [k for k, _ in plotted]}),
    )
    compare(tmp_path / "out", runs=runs_dir)
    md = (tmp_path / "out" / "comparison.md").read_text()
    above_table = md.split("| run |")[0]
    speeds = ["decode/greedy_sentences_per_s", "beam"]
    if status == "overlap":
        assert "**Runs overlapped in time on one machine** (gqa-h4-kv2-sdpa and mqa-h4-kv1" in md
    elif status == "unknown":
        assert "Overlap unknown: 1 of 3 runs do not record when and where" in above_table
    else:
        assert "No two runs trained at the same time on one machine." in above_table
    assert panels["bleu_vs_decode_speed.png"] == (speeds if status == "no overlap" else [])
    assert ("greedy × (in training)" in md) == (status == "no overlap")
    assert ("greedy sentences/s, in training" in md) == (status == "no overlap")
    assert "| greedy sent/s (in training) |" in md  # the table keeps them, labelled


SETUP = {
    "host": "vm", "cpu": "Some CPU", "threads": 2, "torch": "2.13.0", "test_sentences": 1000,
    "train_sentences": 512, "max_tokens": 4096, "beam_size": 5, "batch_size": 128, "rounds": 3,
}  # fmt: skip


def write_speeds(run_dir: Path, greedy: float, setup: dict = SETUP) -> None:
    speeds = {TRAIN_KEY: 1000.0, GREEDY_KEY: greedy, BEAM_KEY: greedy / 4}
    (run_dir / "speed.json").write_text(json.dumps({"speeds": speeds, "setup": setup}))


@pytest.mark.slow  # 7 s of CPU
def test_kept_speed_records_give_the_side_by_side_columns(
    headline_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """Speeds kept in the runs' speed.json (no checkpoints needed): the side-by-side columns,
    ratios and plots come back. A seed measured apart or not at all (seed 3 here) is left
    out by name and the means take the measured seeds; a design with no measured run at
    all leaves the side-by-side speeds out, saying so."""
    for run_dir in headline_dir.iterdir():
        seed = int(run_dir.name.rsplit("_s", 1)[1])
        if seed == 1:
            write_speeds(run_dir, 200.0)
        elif seed == 2:
            write_speeds(run_dir, 100.0)
        elif run_dir.name.startswith("mqa"):  # another measurement: not comparable
            write_speeds(run_dir, 5000.0, SETUP | {"threads": 16})
    panels = {}
    monkeypatch.setattr(
        comparison,
        "plot_bleu_against",
        lambda runs, path, plotted, *_: panels.update({path.name: [k for k, _ in plotted]}),
    )
    compare(tmp_path / "out", runs=headline_dir)
    md = (tmp_path / "out" / "comparison.md").read_text()
    assert "(kept in each run's `speed.json`) in one process" in md
    assert "on Some CPU (vm), 2 threads, torch 2.13.0; decoding 1000 test sentences" in md
    assert "6 of 18 runs (mha [mha_s3], gqa82 [gqa82_s3]," in md
    assert "have no speed.json from that measurement (measured apart or not at all)" in md
    assert panels["bleu_vs_decode_speed.png"] == [GREEDY_KEY, BEAM_KEY]
    means = md.split("## Means over seeds")[1].split("## Designs of one KV-cache size")[0]
    (row,) = [line for line in means.splitlines() if line.startswith("| mqa |")]
    assert row.endswith("| 1,000 | 150.0 | 37.5 |")  # the mean of seeds 1 and 2 only
    with open(tmp_path / "out" / "comparison.csv", newline="") as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    assert rows["mqa [mqa_s3]"]["greedy sent/s (side by side)"] == ""

    for run_dir in headline_dir.glob("mla16_s*"):
        (run_dir / "speed.json").unlink(missing_ok=True)
    compare(tmp_path / "out", runs=headline_dir)
    md = (tmp_path / "out" / "comparison.md").read_text()
    assert "**Side-by-side speeds left out:**" in md
    assert "and mla16 has no measured run at all" in md
    assert "side by side" not in md.split("## Means over seeds")[1].split("\n\n## ")[0]


def test_overlap_reads_naive_and_aware_times_and_tells_machines_by_boot_id(
    runs_dir: Path, tmp_path: Path
) -> None:
    """A naive timestamp (taken as UTC) beside aware ones compares without a TypeError; two
    runs at once on hosts both named vm overlap only if their kernels' boot ids agree, and
    runs without a boot id fall back to the host name, said so."""
    times = {
        "0": when(0, 2, host="vm") | {"run/start": "2026-01-01T00:00:00"},  # naive
        "1": when(1, 3, host="vm"),
        "2": when(4, 5, host="vm"),
    }
    for boots, status in ((("a", "b", "a"), "no overlap"), (("a", "a", "a"), "overlap")):
        for (job, figures), boot in zip(times.items(), boots, strict=True):
            path = runs_dir / job / "summary.json"
            record = json.loads(path.read_text()) | figures | {"run/boot_id": boot}
            path.write_text(json.dumps(record))
        compare(tmp_path / "out", runs=runs_dir)
        md = (tmp_path / "out" / "comparison.md").read_text()
        assert ("**Runs overlapped in time on one machine**" in md) == (status == "overlap")
        assert "Machines are told apart by the kernel's boot id." in md
        assert "other work on the same cores (jobs outside this project" in md
    path = runs_dir / "1" / "summary.json"
    path.write_text(
        json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "run/boot_id"})
    )
    compare(tmp_path / "out", runs=runs_dir)
    md = (tmp_path / "out" / "comparison.md").read_text()
    assert "1 of 3 runs recorded none, and for them by host name, which clones share." in md


@pytest.mark.slow  # times every run: 5 s of CPU
def test_speed_true_measures_every_run_side_by_side(
    smoke_run_dir: Path, multi30k_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """Two trained runs (the smoke run, MHA, and its MQA conversion): speed=true decodes each
    run's checkpoint and trains it in this process, and the plots and ratios take those
    figures; the in-training figures stay the summaries' own, labelled so."""
    from multihead.checkpoints.conversion import convert_kv_heads
    from multihead.host import cpu_model

    root = tmp_path / "runs"
    ckpt = smoke_run_dir / "checkpoints" / "last.ckpt"
    for job, kind, kv in (("mha", "mha", 4), ("mqa", "mqa", 1)):
        (root / job / "checkpoints").mkdir(parents=True)
        figures = summary(kind, 4, kv, **when(0, 1), seed=1)  # overlapping runs
        (root / job / "summary.json").write_text(json.dumps(figures))
        keep_config(root / job, 1)
    shutil.copy(ckpt, root / "mha" / "checkpoints" / "last.ckpt")
    convert_kv_heads(ckpt, 1, root / "mqa" / "checkpoints" / "last.ckpt")
    options = {"rounds": 1, "limit": 8, "train_sentences": 16, "max_tokens": 256, "threads": 1}
    with pytest.raises(FileNotFoundError, match="speed=true: no checkpoint for mha-h4-kv4-sdpa"):
        compare(tmp_path / "out", runs=root, speed=True, speed_options=options)
    panels = {}
    monkeypatch.setattr(
        comparison,
        "plot_bleu_against",
        lambda runs, path, plotted, *_: panels.update({path.name: [k for k, _ in plotted]}),
    )
    compare(
        tmp_path / "out",
        runs=root,
        speed=True,
        speed_options=options,
        checkpoint="checkpoints/last.ckpt",
        local_dir=str(multi30k_dir),
    )
    md = (tmp_path / "out" / "comparison.md").read_text()
    assert "**Runs overlapped in time on one machine**" in md
    assert (
        "measured by `compare.py speed=true` (kept in each run's `speed.json`) in one process" in md
    )
    assert f"on {cpu_model()} (" in md and "1 threads" in md and "decoding 8 test" in md
    assert "| greedy × (side by side) |" in md and "greedy × (in training)" not in md
    assert panels["bleu_vs_decode_speed.png"] == [GREEDY_KEY, BEAM_KEY]
    with open(tmp_path / "out" / "comparison.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for row, kv in zip(rows, (4, 1), strict=True):
        for column in ("train tgt tok/s", "greedy sent/s", "beam sent/s"):
            assert float(row[f"{column} (side by side)"]) > 0
        assert float(row["greedy sent/s (in training)"]) == 400.0 / kv  # the summary's own
    # Kept in each run's speed.json: a rerun without checkpoints gives the same report.
    for job in ("mha", "mqa"):
        record = json.loads((root / job / "speed.json").read_text())
        assert record["setup"]["threads"] == 1 and record["speeds"][GREEDY_KEY] > 0
        (root / job / "checkpoints" / "last.ckpt").unlink()
    compare(tmp_path / "again", runs=root, local_dir=str(multi30k_dir))
    assert (tmp_path / "again" / "comparison.csv").read_text() == (
        tmp_path / "out" / "comparison.csv"
    ).read_text()
    assert (tmp_path / "again" / "comparison.md").read_text() == md.replace("/out", "/again")


def test_wandb_true_logs_into_the_group_the_runs_recorded(
    runs_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """Without wandb_group= the comparison joins the group the runs' summaries recorded;
    their saved Hydra configs hold it unresolved (a sweep's group reads
    ${hydra:sweep.dir}), which only the sweep's own jobs can resolve."""
    import wandb

    for job in ("0", "1", "2"):
        path = runs_dir / job / "summary.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | {"run/wandb_group": "sw-1"}))
        (runs_dir / job / ".hydra").mkdir(exist_ok=True)
        (runs_dir / job / ".hydra" / "config.yaml").write_text(
            "wandb_group: sw-${path_name:${hydra:sweep.dir}}\n"
        )
    started = []
    init = wandb.init
    monkeypatch.setattr(wandb, "init", lambda *a, **k: started.append(init(*a, **k)) or started[-1])
    monkeypatch.setenv("WANDB_MODE", "offline")
    compare(tmp_path / "out", runs=runs_dir, wandb_log=True)
    assert [run.group for run in started] == ["sw-1"]


def test_wandb_true_names_the_group_summaries_from_before_it_lack(
    runs_dir: Path, tmp_path: Path, monkeypatch, caplog
) -> None:
    """Runs kept from before summaries recorded run/wandb_group: one line says the group is
    missing and how to give it; the comparison is logged without one."""
    import wandb

    started = []
    init = wandb.init
    monkeypatch.setattr(wandb, "init", lambda *a, **k: started.append(init(*a, **k)) or started[-1])
    monkeypatch.setenv("WANDB_MODE", "offline")
    compare(tmp_path / "out", runs=runs_dir, wandb_log=True)
    (line,) = [r.getMessage() for r in caplog.records if "wandb_group" in r.getMessage()]
    assert line.startswith("wandb=true: 3 of 3 runs record no run/wandb_group (summaries")
    assert line.endswith("so the comparison's group is missing; give wandb_group=NAME")
    assert "\n" not in line and [bool(run.group) for run in started] == [False]


@pytest.mark.slow  # 4 s of CPU
def test_wandb_true_logs_the_tables_and_plots_to_a_run_of_its_own(
    headline_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """Offline: the comparison is a run of its own in the group; its table of runs, its
    table of configurations over seeds (Holm's p and the verdicts) and its plots are read
    back from wandb's files (the tables in wandb's Table JSON, the images as PNG)."""
    import wandb

    started = []
    init = wandb.init
    monkeypatch.setattr(wandb, "init", lambda *a, **k: started.append(init(*a, **k)) or started[-1])
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "out"
    compare(out, runs=headline_dir, wandb_log=True, wandb_group="sweep1", equivalence_margin=0.5)
    (run,) = started
    assert (run.group, run.job_type, run.name) == ("sweep1", "comparison", "comparison-sweep1")
    assert wandb.run is None  # finished
    (files,) = (out / "wandb").glob(f"offline-run-*-{run.id}/files")
    tables = files / "media" / "table"
    (table_file,) = tables.glob("comparison_*.table.json")
    table = json.loads(table_file.read_text())
    with open(out / "comparison.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert table["columns"] == rows[0]
    assert [r[0] for r in table["data"]] == [r[0] for r in rows[1:]]
    kv = table["columns"].index("KV-cache bytes/token")
    assert [r[kv] for r in table["data"]][::3] == [4096, 1024, 2048, 512, 256, 512]
    (seeds_file,) = tables.glob("seed_means_*.table.json")
    seeds = json.loads(seeds_file.read_text())
    by_name = {(r[0], r[1]): dict(zip(seeds["columns"], r, strict=True)) for r in seeds["data"]}
    assert round(by_name["mla16", "MHA"]["p (Holm)"], 3) == 0.023
    assert by_name["mla16", "MHA"]["verdict"] == "lower"
    assert round(by_name["mqa", "MHA"]["p (Holm)"], 3) == 0.079
    assert by_name["mqa", "mla32"]["verdict"] == "no detectable difference"
    assert len(seeds["data"]) == 6  # five designs against MHA, one contrast
    images = sorted(p.name.split("_")[0] for p in (files / "media" / "images").glob("*.png"))
    assert len(images) == 4 and {"bleu", "delta", "validation"} <= set(images)


def test_mha_shaped_designs_are_compared_with_plain_mha_not_taken_for_it() -> None:
    """Differential attention and ALiBi are MHA-shaped (kind "mha"); the reference is the
    plain layer, whose tag names no design or positional part."""
    from multihead.analysis.groups import is_mha, mha_baseline
    from multihead.analysis.runs import RunResult

    def run(tag: str) -> RunResult:
        return RunResult(tag, {"kind": "mha", "tag": tag, "num_heads": 8, "seed": 1})

    plain, diff, alibi = run("mha8"), run("mha8-diff"), run("mha8-alibi")
    assert is_mha(plain) and not is_mha(diff) and not is_mha(alibi)
    assert mha_baseline(diff, [alibi, diff, plain]) is plain
    assert mha_baseline(plain, [alibi, diff, plain]) is None


def test_long_context_rows_give_what_each_design_buys(runs_dir: Path, tmp_path: Path) -> None:
    """long_context= (the benchmark's --json): each kind's decoding speed at each setting as
    a multiple of MHA's, from ours-static's ms per step, beside the cache its benchmark
    design and these runs hold against MHA's; a kind the benchmark lacks is blank."""
    measured = [
        ("mha", "ours-static", 100.0, 2048),
        ("mha", "hf-static", 50.0, 2048),
        ("mqa", "ours-static", 25.0, 128),
        ("mla", "ours-static", 40.0, 256),
    ]
    rows = [
        {"design": d, "dtype": "fp32", "context": 16384, "batch": 1, "candidate": c, "ms": ms,
         "cache_bytes": cache}
        for d, c, ms, cache in measured
    ]  # fmt: skip
    bench = tmp_path / "long_context.json"
    bench.write_text(json.dumps(rows))
    compare(tmp_path / "out", runs=runs_dir, long_context=bench)
    md = (tmp_path / "out" / "comparison.md").read_text()
    section = md.split("## What each design buys: decoding at long context")[1].split("##")[0]
    assert (
        "| kind | these runs: cache × MHA | benchmark: cache × MHA | fp32 16k × 1: speed × MHA |"
        in section
    )
    assert "| mqa | mqa-h4-kv1-sdpa (0.25) | 0.0625 | 4.00 |" in section  # 100 / 25 ms
    assert "| mha | mha-h4-kv4-sdpa (1) | 1 | 1.00 |" in section
    assert "| gqa | gqa-h4-kv2-sdpa (0.5) | – | – |" in section  # not in the benchmark


def test_a_long_context_file_that_is_not_the_benchmark_s_is_named(runs_dir, tmp_path):
    bad = tmp_path / "rows.json"
    bad.write_text(json.dumps([{"design": "mha"}]))
    with pytest.raises(ValueError, match=r"long_context=.*rows.json: expected a list of rows"):
        compare(tmp_path / "out", runs=runs_dir, long_context=bad)
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_runs_of_one_name_whose_configs_differ_beyond_the_seed_are_not_pooled(tmp_path):
    """Two settings of a design's option once shared a run name, and their runs were
    averaged as two seeds of one model. Seeds, and where runs write, may differ (the
    task_name of a grid's experiment names its output directory)."""
    root = tmp_path / "runs"
    configs = {
        "a": "seed: 1\ntask_name: grid\npaths:\n  log_dir: /a\n"
        "attention:\n  design_options:\n    cap: 5\n",
        "b": "seed: 2\ntask_name: train\npaths:\n  log_dir: /b\n"
        "attention:\n  design_options:\n    cap: 5\n",
        "c": "seed: 3\npaths:\n  log_dir: /c\nattention:\n  design_options:\n    cap: 3\n",
    }
    for job, config in configs.items():
        (root / job / ".hydra").mkdir(parents=True)
        (root / job / ".hydra" / "config.yaml").write_text(config)
        (root / job / "summary.json").write_text(json.dumps(summary("mha", 4, 4)))
    shutil.move(root / "c", tmp_path / "c")  # a and b: seeds of one configuration
    runs, _ = compare(tmp_path / "out", runs=root)
    assert len(runs) == 2
    shutil.move(tmp_path / "c", root / "c")
    with pytest.raises(ValueError) as error:
        compare(tmp_path / "out", runs=root)
    message = str(error.value)
    assert "share the run name 'mha-h4-kv4-sdpa'" in message and "\n" not in message
    assert "differ in attention.design_options.cap (5 against 3)" in message


def test_pool_despite_pools_seeds_that_differ_in_a_named_key_and_the_report_says_so(tmp_path):
    """A key a later commit added, absent from the older run's config, differs from the
    newer run's value; the user names it, and the report states the pooling."""
    root = tmp_path / "runs"
    configs = {"a": "seed: 1\nmodule:\n  lr: 1\n", "b": "seed: 2\nmodule:\n  lr: 1\n  decay: x\n"}
    for job, config in configs.items():
        (root / job / ".hydra").mkdir(parents=True)
        (root / job / ".hydra" / "config.yaml").write_text(config)
        (root / job / "summary.json").write_text(json.dumps(summary("mha", 4, 4)))
    with pytest.raises(ValueError, match=r"differ in module.decay \(None against 'x'\)"):
        compare(tmp_path / "out", runs=root)
    runs, paths = compare(tmp_path / "out", runs=root, pool_despite=["module.decay"])
    assert len(runs) == 2
    text = (tmp_path / "out" / "comparison.md").read_text()
    assert "configs differ in module.decay (pool_despite" in text
    with pytest.raises(ValueError, match=r"^pool_despite='module.decay': expected a list"):
        compare(tmp_path / "out2", runs=root, pool_despite="module.decay")
    # a key in which no seeds differ (here misspelt) is refused by name, not silently passed
    with pytest.raises(ValueError, match=r"^pool_despite names module.decy, but no seeds"):
        compare(tmp_path / "out3", runs=root, pool_despite=["module.decay", "module.decy"])
    assert not (tmp_path / "out3").exists()


def test_seeds_on_another_cpu_model_are_pooled_only_when_the_user_says(
    headline_dir: Path, tmp_path: Path
) -> None:
    """Seed 3 of MQA ran on another CPU model (run/cpu): refused by name, pooled with
    pool_despite=[cpu], and the report says so."""
    path = headline_dir / "mqa_s3" / "summary.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"run/cpu": "Other CPU"}))
    with pytest.raises(ValueError) as error:
        compare(tmp_path / "out", runs=headline_dir)
    message = str(error.value)
    assert "pooled as seeds of 'mqa' but ran on cpu None and 'Other CPU' (run/cpu)" in message
    assert "\n" not in message and not (tmp_path / "out").exists()
    compare(tmp_path / "out", runs=headline_dir, pool_despite=["cpu"])
    md = (tmp_path / "out" / "comparison.md").read_text()
    assert "configs differ in cpu (pool_despite" in md


def test_a_run_without_its_config_is_refused_not_pooled(headline_dir: Path, tmp_path: Path):
    """Trained with hydra.output_subdir=null: nothing to check it against; refused by its
    directory in one line, before anything is written."""
    shutil.rmtree(headline_dir / "gqa84_s2" / ".hydra")
    result = run_script("compare.py", f"runs={headline_dir}", f"out={tmp_path / 'out'}")
    assert result.returncode != 0
    (line,) = result.stderr.strip().splitlines()
    assert f"{headline_dir / 'gqa84_s2'}: no saved config" in line
    assert not (tmp_path / "out").exists()


def test_a_kept_record_holds_its_config_and_curves_beside_its_summary(tmp_path: Path) -> None:
    """docs/long_context/runs keeps each run flat: summary.json, config.yaml (Hydra's
    .hydra/config.yaml) and metrics.csv (csv/metrics.csv) side by side."""
    run = tmp_path / "runs" / "mha_s1"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(summary("mha", 4, 4)))
    (run / "config.yaml").write_text("seed: 7\n")
    (run / "metrics.csv").write_text(METRICS_CSV)
    (found,) = load_local_runs(tmp_path / "runs")
    assert found.config == {"seed": 7} and found.seed == 7
    assert found.curves["val/bleu"] == [(19, 1.5), (39, 2.5)]


def test_the_declared_family_is_read_for_translation_too(headline_dir: Path, tmp_path: Path):
    """The family names three designs against MHA: Holm over those three (by hand from the
    unadjusted p's in the table), the two MLA designs and the contrast exploratory, their
    p's unadjusted and apart."""
    family = tmp_path / "family.yaml"
    family.write_text(
        "declared: '2025-12-31T00:00:00+00:00'\ncommit: abc1234\ntests:\n"
        "  - task: translation\n    baseline: mha\n    designs: [gqa84, gqa82, mqa]\n"
        "    metrics: [test/bleu]\n"
    )
    compare(tmp_path / "out", runs=headline_dir, family=str(family))
    md = (tmp_path / "out" / "comparison.md").read_text()
    means = md.split("## Means over seeds")[1].split("## Designs of one KV-cache size")[0]
    cells = {
        row.split(" | ")[0][2:]: row.split(" | ")
        for row in means.splitlines()
        if row.startswith("| ") and not row.startswith("| configuration")
    }
    raw = {name: float(cells[name][7]) for name in ("gqa84", "gqa82", "mqa")}
    ordered = sorted(raw, key=raw.get)
    steps = [min(1.0, (3 - i) * raw[name]) for i, name in enumerate(ordered)]
    for i, name in enumerate(ordered):
        assert abs(float(cells[name][8]) - max(steps[: i + 1])) < 1.5e-3, cells[name]
    for name in ("mla16", "mla32"):
        assert cells[name][8] == "–" and cells[name][11].startswith("exploratory (unadjusted p")
    held = md.split("## The family of tests")[1]
    assert "whole family of 3 tests declared in" in held
    assert "| translation | mqa | mla32 | test/bleu |" in held.split("### Exploratory tests")[1]


def test_translation_designs_trained_longer_say_whether_their_order_holds(
    headline_dir: Path, tmp_path: Path
):
    """Seed 1 of MHA, MQA and gqa84 trained twice as long: MQA (−1.92 BLEU over the three
    seeds) is 1.0 above MHA there, so its verdict says the order flips; gqa84 (−0.78) is
    1.0 below, and its order holds, with that difference in the family's table."""
    for run in headline_dir.iterdir():
        seed = json.loads((run / "summary.json").read_text())["seed"]
        (run / ".hydra" / "config.yaml").write_text(f"seed: {seed}\ntrainer:\n  max_steps: 3\n")
    longer = tmp_path / "longer"
    for name, kind, bleu in (("mha", "mha", 20.0), ("mqa", "mqa", 21.0), ("gqa84", "gqa", 19.0)):
        figures = summary(kind, 8, 1, seed=1, **when(20, 21)) | {"run_name": name}
        (longer / name / ".hydra").mkdir(parents=True)
        (longer / name / "summary.json").write_text(json.dumps(figures | {"test/bleu": bleu}))
        (longer / name / ".hydra" / "config.yaml").write_text("seed: 1\ntrainer:\n  max_steps: 6\n")
    family = tmp_path / "family.yaml"
    family.write_text(
        "declared: '2025-12-31T00:00:00+00:00'\ncommit: abc1234\ntests:\n"
        "  - task: translation\n    baseline: mha\n    designs: [gqa84, mqa]\n"
        "    metrics: [test/bleu]\n"
    )
    compare(tmp_path / "out", runs=headline_dir, family=str(family), longer=longer)
    md = (tmp_path / "out" / "comparison.md").read_text()
    flip = "the order flips at 6 steps: about learning speed at this budget"
    means = md.split("## Means over seeds")[1].split("\n## ")[0]
    rows = {line.split(" | ")[0][2:]: line for line in means.splitlines() if line.startswith("| ")}
    assert flip in rows["mqa"] and "flips" not in rows["gqa84"]
    held = md.split("## The family of tests")[1].split("### Exploratory tests")[0]
    assert "| Δ of the same seeds → trained longer (steps) | verdict |" in held
    # beside it, the same seed's difference at the compared budget, read from its records
    bleu = {s["run_name"]: s["test/bleu"] for run in headline_dir.iterdir()
            if (s := json.loads((run / "summary.json").read_text()))["seed"] == 1}  # fmt: skip
    (gqa,) = [line for line in held.splitlines() if line.startswith("| translation | gqa84 |")]
    assert f"| {bleu['gqa84'] - bleu['mha']:+.4f} → -1.0000 at 6 (1 seed) |" in gqa
