"""The ``precision: auto`` setting, resolved once per run."""

from __future__ import annotations

import torch

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "auto")

# Measured with scripts/benchmark_training.py on the 2-core CPU machines (docs/benchmarks.md).
CPU_AUTO_PRECISION = "32-true"


def resolve_precision(precision: str, accelerator: str) -> str:
    """Turn ``auto`` into a concrete Lightning precision for ``accelerator``.

    ``auto`` picks bf16-mixed on GPUs with native bf16 (compute capability 8.0 on: A100,
    H100, RTX 30xx on), 16-mixed (fp16 with loss scaling) on older GPUs (V100, T4), and
    :data:`CPU_AUTO_PRECISION` on CPU. A V100 or T4 can emulate bf16, so
    ``torch.cuda.is_bf16_supported()`` says True there unless emulation is excluded; the
    emulated kernels are much slower than fp16 ones.
    """
    precision = str(precision)
    if precision not in PRECISIONS:
        raise ValueError(
            f"trainer.precision={precision!r}; expected one of {', '.join(PRECISIONS)}"
        )
    if precision != "auto":
        return precision
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if on_gpu:
        native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        return "bf16-mixed" if native_bf16 else "16-mixed"
    return CPU_AUTO_PRECISION
