"""``trainer.precision``: ``auto`` resolved once per run, and the Trainer arguments that run it."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "auto")

# Measured with scripts/benchmark_training.py on the 2-core CPU machines (docs/benchmarks.md).
CPU_AUTO_PRECISION = "32-true"


def _on_gpu(accelerator: str) -> bool:
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def _on_cpu(accelerator: str) -> bool:
    return accelerator == "cpu" or (
        accelerator == "auto"
        and not torch.cuda.is_available()
        and not torch.backends.mps.is_available()
    )


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
    if _on_gpu(accelerator):
        native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        return "bf16-mixed" if native_bf16 else "16-mixed"
    return CPU_AUTO_PRECISION


def trainer_precision(precision: str, accelerator: str) -> dict[str, Any]:
    """The Trainer's ``precision`` and precision ``plugins`` that run ``precision`` as named.

    ``auto`` is resolved first (:func:`resolve_precision`). Given ``precision="16-mixed"``
    on the CPU, Lightning 2.6 runs bf16-mixed instead ("AMP with fp16 is not supported on
    CPU"), although torch's CPU autocast runs fp16 and ``torch.amp.GradScaler("cpu")``
    scales its loss. There the run gets Lightning's own ``MixedPrecision("16-mixed",
    "cpu")`` plugin with a CPU loss scaler instead of the flag, which Lightning takes as
    given.

    A 32-true run on a GPU also gets ``float32_matmul_precision="high"``: TF32 tensor cores
    for its fp32 matmuls (Ampere on), which torch leaves off by default. The CPU keeps
    ``"highest"``: there "high" may let oneDNN round fp32 matmuls to bf16.

    Returns:
        ``{"precision": ..., "plugins": [...], "float32_matmul_precision": ...}``: pass the
        first two to ``lightning.Trainer`` (the plugins beside any others; ``precision`` is
        None when a plugin carries it) and the third, unless None, to
        ``torch.set_float32_matmul_precision``.
    """
    resolved = resolve_precision(precision, accelerator)
    tf32 = "high" if resolved == "32-true" and _on_gpu(accelerator) else None
    if resolved == "16-mixed" and _on_cpu(accelerator):
        plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
        return {"precision": None, "plugins": [plugin], "float32_matmul_precision": tf32}
    return {"precision": resolved, "plugins": [], "float32_matmul_precision": tf32}
