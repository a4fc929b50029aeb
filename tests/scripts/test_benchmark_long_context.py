"""scripts/benchmark_long_context.py at tiny sizes: every candidate decodes from a cache
prefilled to the context, the bytes it reports are the cache's storage, files are written,
and bad options fail in one line."""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is the [hf] extra")

from helpers.scripts import script_module  # noqa: E402

TINY = ["--hidden", "32", "--heads", "4", "--layers", "2", "--ffn", "64", "--vocab", "50"]


@pytest.fixture(scope="module")
def bench():
    return script_module("benchmark_long_context.py")


@pytest.mark.parametrize("candidate", ["hf-static", "hf-dynamic", "ours-append", "ours-static"])
def test_each_cache_holds_the_context_and_decodes_from_it(bench, candidate):
    shape = bench.Shape(32, 4, 2, 64, 50)
    model = bench.prepare(bench.build_model("gqa", shape, bench.DTYPES["fp32"], "cpu"), "gqa",
                          candidate)  # fmt: skip
    cache = bench.filled_cache(candidate, model, 20, 3, 2, model.device)
    assert [cache.get_seq_length(i) for i in range(2)] == [20, 20]

    def step(cache, batch):
        model(input_ids=torch.zeros(batch, 1, dtype=torch.long), cache=cache, use_cache=True)

    times = bench.time_steps(step, cache, 3, 1, model.device)  # a warm-up and one step
    assert len(times) == 1 and [cache.get_seq_length(i) for i in range(2)] == [22, 22]
    # Storage held: static buffers of max_len = 22 positions; appended ones with 256 spare
    # after the 20 prefilled; HF's dynamic ones of exactly the positions.
    positions = {"hf-static": 22, "ours-static": 22, "hf-dynamic": 22, "ours-append": 276}
    per_position = 2 * 3 * 1 * 8 * 4  # K and V, batch 3, G = 1 (H/4), D = 8, fp32
    assert bench.held_bytes(cache) == 2 * per_position * positions[candidate]  # 2 layers


@pytest.mark.slow  # 12 rows, each timed over 2 rounds
def test_a_run_writes_its_rows_and_figure(bench, tmp_path, capsys):
    out, figure = tmp_path / "rows.json", tmp_path / "speed.png"
    bench.main([
        *TINY, "--designs", "mha", "mqa", "--settings", "16x2", "32x1", "--steps", "1",
        "--rounds", "2", "--prefill", "8", "--candidates", "hf-static", "ours-static",
        "ours-append", "--json", str(out), "--plot", str(figure),
    ])  # fmt: skip
    rows = json.loads(out.read_text())
    steps = [r for r in rows if r["note"] != "prefill"]
    assert len(steps) == 2 * 2 * 3 and all(r["ms"] > 0 and r["roofline_ms"] > 0 for r in steps)
    assert {r["x_hf"] for r in steps if r["candidate"] == "hf-static"} == {1.0}
    assert {r["x_mha"] for r in steps if r["design"] == "mha"} == {1.0}
    assert all(r["ms_min"] <= r["ms"] <= r["ms_max"] and len(r["round_ms"]) == 2 for r in steps)
    # the spread of "time x HF static" is that of the per-round ratios to hf-static's round
    hf = {(r["design"], r["context"], r["batch"]): r["round_ms"] for r in steps
          if r["candidate"] == "hf-static"}  # fmt: skip
    for r in steps:
        hf_ms = hf[r["design"], r["context"], r["batch"]]
        ratios = [a / b for a, b in zip(r["round_ms"], hf_ms, strict=True)]
        assert r["x_hf_min"] == pytest.approx(min(ratios))
        assert r["x_hf_max"] == pytest.approx(max(ratios))
    assert len([r for r in rows if r["note"] == "prefill"]) == 2 * 3
    assert figure.stat().st_size > 0
    assert "read bandwidth" in capsys.readouterr().out


@pytest.mark.parametrize(
    "options, message",
    [
        (["--settings", "4096"], "setting '4096': expected CONTEXTxBATCH, e.g. 4096x8"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--heads", "6"], "--heads (6) must divide --hidden (1024), a multiple of 4"),
    ],
)
def test_bad_options_fail_in_one_line(bench, options, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["benchmark_long_context.py", *options])
    with pytest.raises(SystemExit) as stop:
        bench.main()
    assert stop.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
