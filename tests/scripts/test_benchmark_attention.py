"""scripts/benchmark_attention.py runs in every dtype it offers, here on the CPU at tiny sizes."""

from __future__ import annotations

import csv
import importlib.util
import math

import pytest
import torch

from helpers import REPO_ROOT


def load_script():
    path = REPO_ROOT / "scripts" / "benchmark_attention.py"
    spec = importlib.util.spec_from_file_location("benchmark_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


benchmark = load_script()


def test_textbook_layer_masks_in_fp16() -> None:
    """The causal mask fits fp16 (a -1e9 fill does not), and fp16 agrees with fp32."""
    torch.manual_seed(0)
    layer = benchmark.TextbookAttention(16, 4)
    x = torch.randn(2, 5, 16)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    ref = layer(x, x, causal)
    out = layer.half()(x.half(), x.half(), causal)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    # Row 0 sees only key 0: changing the other keys leaves it alone.
    y = x.half().clone()
    y[:, 1:] = 0
    torch.testing.assert_close(layer(y, y, causal)[:, 0], out[:, 0])


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_benchmark_runs_on_the_cpu_in_low_precision(dtype, tmp_path) -> None:
    out = tmp_path / "bench.csv"
    benchmark.main(
        [
            f"--dtype={dtype}",
            "--embed-dim=16",
            "--num-heads=4",
            "--gqa-kv-heads=2",
            "--shapes=2x8",
            "--repeats=1",
            "--warmup=0",
            "--memory-len=16",
            "--decode-context=8",
            "--decode-batch=2",
            "--backends",
            "math",
            "sdpa",
            f"--csv={out}",
        ]
    )
    with out.open() as f:
        rows = {(r["figure"], r["candidate"]): r for r in csv.DictReader(f)}
    for figure, candidate in [
        ("fwd+bwd_ms", "textbook"),
        ("fwd+bwd_ms", "ours math mha"),
        ("fwd+bwd_ms", "ours sdpa gqa"),
        ("peak_mib", "textbook"),
        ("decode_step_ms", "textbook (no cache)"),
        ("decode_step_ms", "ours sdpa mqa"),
    ]:
        row = rows[figure, candidate]
        assert row["note"] == "" and math.isfinite(float(row["value"])), row
