"""The attention layer's own public calls on the fake cuda:0, with every backend.

The model's paths (test_model.py) never make some calls that other models make: causal
attention with a key padding mask (a left-padded decoder-only batch), a chunk of several new
queries on a KV cache (L < S, where the mask builder writes the causal rows itself), float
and bool masks, a static cache. Each call runs here with each backend in each precision its
kernel takes; the ones a backend's rules refuse are listed with the refusal they must give.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from harness import AUTOCAST, CUDA, FakeCuda, KernelRuleError, autocast, kernel_stubs

import multihead.attention.masks as masks
from multihead.attention import MultiHeadAttention
from multihead.attention.backends import BackendUnavailableError

pytestmark = pytest.mark.fake_cuda

B, E, H, G = 3, 64, 4, 2  # head size 16 (FlexAttention's least on CUDA); grouped K/V heads
MEMORY = 6  # cross-attention keys
MAX_LEN = 8  # a static cache's buffer

# Each call returns (output, L, S) for each call of the layer, S as the kernel sees it.
Steps = list[tuple[torch.Tensor, int, int]]


def _x(length: int) -> torch.Tensor:
    return torch.randn(B, length, E, device=CUDA)


def _padding(length: int) -> torch.Tensor:
    """``(B, length)`` True = padding. A fake tensor has no values: what is checked is where
    and in what dtype every tensor the mask makes lives, and that holds for any values."""
    return torch.zeros(B, length, dtype=torch.bool, device=CUDA)


def _full(*, cross: bool = False, **given: Callable[[], torch.Tensor] | bool):
    """Attention from 5 positions to themselves, or to a memory of 6 (``cross``), with
    the ``given`` masks (each made on the fake device when the call runs)."""

    def call(layer: MultiHeadAttention) -> Steps:
        kwargs = {k: v() if callable(v) else v for k, v in given.items()}
        memory = _x(MEMORY) if cross else None
        return [(layer(_x(5), memory, **kwargs), 5, MEMORY if cross else 5)]

    return call


def _cached(*, static: bool, padding: bool) -> Callable[[MultiHeadAttention], Steps]:
    """Causal self-attention through a KV cache: a prefill of 4 positions, a chunk of 2
    (L = 2 < S = 6: the causal rows are written into the mask), then one step."""

    def call(layer: MultiHeadAttention) -> Steps:
        cache = layer.make_kv_cache(B, MAX_LEN, static=static)
        steps, seen = [], 0
        with torch.no_grad():
            for length in (4, 2, 1):
                seen += length
                keys = MAX_LEN if static else seen  # a static cache attends over its buffer
                pad = _padding(keys) if padding else None
                out = layer(_x(length), is_causal=True, key_padding_mask=pad, kv_cache=cache)
                steps.append((out, length, keys))
        return steps

    return call


def _cached_cross(layer: MultiHeadAttention) -> Steps:
    """Cross-attention through a cache: the memory projected at the first step, then read."""
    cache = layer.make_kv_cache(B, MEMORY)
    memory, pad = _x(MEMORY), _padding(MEMORY)
    with torch.no_grad():
        return [
            (layer(_x(1), memory, key_padding_mask=pad, kv_cache=cache), 1, MEMORY)
            for _ in range(2)
        ]


CALLS: dict[str, Callable[[MultiHeadAttention], Steps]] = {
    "causal": _full(is_causal=True),
    "causal_padding": _full(is_causal=True, key_padding_mask=lambda: _padding(5)),
    "bool_mask": _full(attn_mask=lambda: torch.zeros(5, 5, dtype=torch.bool, device=CUDA)),
    "float_mask": _full(attn_mask=lambda: torch.zeros(B, 1, 5, 5, device=CUDA)),
    "causal_padding_float_mask": _full(
        is_causal=True,
        key_padding_mask=lambda: _padding(5),
        attn_mask=lambda: torch.zeros(5, 5, device=CUDA),
    ),
    "cross_padding": _full(cross=True, key_padding_mask=lambda: _padding(MEMORY)),
    "cached_causal": _cached(static=False, padding=False),
    "cached_causal_padding": _cached(static=False, padding=True),
    "static_cached_causal": _cached(static=True, padding=False),
    "static_cached_causal_padding": _cached(static=True, padding=True),
    "cached_cross_padding": _cached_cross,
}

# Backends with the precisions their kernels take (as test_model.py; fp16 runs there).
PRECISIONS = {
    "math": ["fp32", "bf16"],
    "sdpa": ["fp32", "bf16"],
    "efficient": ["fp32", "bf16"],
    "flex": ["fp32", "bf16"],
    "cudnn": ["bf16"],
    "flash": ["bf16"],
    "flash_attn": ["bf16"],
}

# What each backend's rules refuse, and how. SDPA's flash kernel takes no mask: any padding,
# attn_mask, causal rows written out (L < S) or static cache reaches it as one; on a GPU the
# layer reports SDPA's refusal as BackendUnavailableError, here the stub refuses first.
# flash-attn takes key padding and is_causal only, not both over several queries.
_NO_MASK = (KernelRuleError, "flash: takes no attn_mask")
_NO_ATTN_MASK = (BackendUnavailableError, "not an arbitrary attn_mask")
_NO_CAUSAL_PADDING = (BackendUnavailableError, "cannot combine is_causal with a key_padding")
REFUSED = {
    **{("flash", call): _NO_MASK for call in CALLS if call != "causal"},
    ("flash_attn", "causal_padding"): _NO_CAUSAL_PADDING,
    ("flash_attn", "bool_mask"): _NO_ATTN_MASK,
    ("flash_attn", "float_mask"): _NO_ATTN_MASK,
    ("flash_attn", "causal_padding_float_mask"): _NO_ATTN_MASK,
    ("flash_attn", "cached_causal_padding"): _NO_CAUSAL_PADDING,
    ("flash_attn", "static_cached_causal"): _NO_ATTN_MASK,
    ("flash_attn", "static_cached_causal_padding"): _NO_ATTN_MASK,
}


def run_call(call: str, backend: str, precision: str) -> tuple[Steps, list[str]]:
    """``CALLS[call]`` on a layer with ``backend`` on the fake device; the steps and the
    fused kernels called."""
    fake = FakeCuda()
    with kernel_stubs() as kernels:  # flash-attn's stand-in must be there when it is built
        torch.manual_seed(0)
        layer = fake.model(MultiHeadAttention(E, H, num_kv_heads=G, backend=backend)).train()
        with fake, autocast(AUTOCAST[precision]):
            steps = CALLS[call](layer)
    return steps, kernels


def _cases():
    for backend, precisions in PRECISIONS.items():
        for precision in precisions:
            for call in CALLS:
                yield call, backend, precision


@pytest.mark.parametrize(("call", "backend", "precision"), list(_cases()))
def test_every_call_with_every_backend(call: str, backend: str, precision: str) -> None:
    if (backend, call) in REFUSED:
        error, message = REFUSED[backend, call]
        with pytest.raises(error, match=message):
            run_call(call, backend, precision)
        return
    steps, kernels = run_call(call, backend, precision)
    dtype = AUTOCAST[precision] or torch.float32
    for out, length, _ in steps:
        assert (out.device, out.dtype, out.shape) == (CUDA, dtype, (B, length, E))
    # Every call reached the named kernel, but cuDNN's length-1 calls (the written-out
    # formula, backends.py); math and sdpa go through PyTorch's own dispatcher.
    fused = backend not in ("math", "sdpa")
    want = [backend for _, L, S in steps if fused and not (backend == "cudnn" and 1 in (L, S))]
    assert kernels == want


def planted_mask_builder(monkeypatch: pytest.MonkeyPatch) -> Callable:
    """``build_attention_mask`` with the causal rows made on the default device: the bug of
    issue 50 (the ``torch.arange(q_len, device=device)`` of masks.py without its device)."""
    source = Path(masks.__file__).read_text()
    line = "torch.arange(q_len, device=device)"
    assert source.count(line) == 1, f"masks.py no longer has {line!r}: plant the bug anew"
    planted = types.ModuleType("planted_masks")
    monkeypatch.setitem(sys.modules, planted.__name__, planted)  # dataclasses look it up
    exec(
        compile(source.replace(line, "torch.arange(q_len)"), masks.__file__, "exec"),
        planted.__dict__,
    )
    return planted.build_attention_mask


@pytest.mark.parametrize("call", ["causal_padding", "cached_causal_padding"])
def test_a_cpu_tensor_in_the_causal_rows_fails(monkeypatch, call: str) -> None:
    run_call(call, "sdpa", "bf16")  # passes as the code is
    original, planted = masks.build_attention_mask, planted_mask_builder(monkeypatch)
    for name, module in list(sys.modules.items()):  # wherever the layer's code holds it
        if name.startswith("multihead.") and (
            getattr(module, "build_attention_mask", None) is original
        ):
            monkeypatch.setattr(module, "build_attention_mask", planted)
    with pytest.raises(RuntimeError, match="cuda:0 and cpu"):
        run_call(call, "sdpa", "bf16")
