"""scripts/benchmark_training.py times head designs side by side: one model per preset."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.scripts import script_module


def bench(capsys, multi30k_dir: Path, cache_dir: Path, *args: str) -> list[str]:
    """The table rows the script prints for the head sweep's configs at the smoke model's
    size, two steps, one block."""
    script_module("benchmark_training.py").main(
        [
            "experiment=compare_heads",  # its wandb_group reads ${hydra:sweep.dir}
            "budget=smoke",
            f"data.local_dir={multi30k_dir}",
            f"paths.cache_dir={cache_dir}",
            "--precisions",
            "32-true",
            "--steps",
            "2",
            "--blocks",
            "1",
            "--threads",
            "1",
            "--no-peak",
            *args,
        ]
    )
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]


def test_each_attention_preset_is_its_own_model(capsys, multi30k_dir, cache_dir) -> None:
    rows = bench(capsys, multi30k_dir, cache_dir, "--attention", "mha_h8", "mqa_h8")
    assert rows[0].startswith("| variant | params | GFLOP/step | s/step | target tok/s |")
    (mha, mqa) = [row.split(" | ") for row in rows[1:]]
    assert (mha[0], mqa[0]) == ("| mha_h8 32-true step", "| mqa_h8 32-true step")
    # The smoke model: d_model 32, 8 heads of 4, 2 + 2 layers, so 6 attention sublayers.
    # MQA's K and V projections are 32 -> 4 (weights and biases) where MHA's are 32 -> 32.
    fewer = 6 * 2 * (32 * 32 + 32 - (32 * 4 + 4))
    assert int(mha[1].replace(",", "")) - int(mqa[1].replace(",", "")) == fewer
    assert float(mqa[2]) < float(mha[2])  # fewer FLOPs per step
    assert mha[-1] == "1.00x |" and float(mqa[4].replace(",", "")) > 0


def test_an_unknown_preset_is_named(capsys, multi30k_dir, cache_dir) -> None:
    with pytest.raises(SystemExit, match="--attention mhx; expected a preset of configs/atte"):
        bench(capsys, multi30k_dir, cache_dir, "--attention", "mha_h8", "mhx")


def test_profile_prints_where_the_step_spends_its_time(capsys, multi30k_dir, cache_dir) -> None:
    rows = bench(capsys, multi30k_dir, cache_dir, "--profile")
    header = rows.index("| op | self CPU | share |")  # bench() keeps the rows, no separators
    table = [row.split(" | ") for row in rows[header + 1 : -2]]
    ops = [cells[0].removeprefix("| ") for cells in table]
    assert ops[0].startswith("GEMMs (mm, addmm") and ops[-1] == "everything else"
    assert all(cells[1].endswith(" s") and cells[2].endswith("% |") for cells in table)
    shares = [float(cells[2].removesuffix("% |")) for cells in table]
    assert sum(shares) == pytest.approx(100, abs=0.1 * len(shares))  # each rounded to 0.1%
    assert shares[0] > 0  # the GEMMs ran
    assert rows[-2].startswith("| variant | params |")  # then the timing table as before
