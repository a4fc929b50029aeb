"""The attention layer's own public calls on the fake cuda:0, with every backend.

The model's paths (test_model.py) never make some calls that other models make: causal
attention with a key padding mask (a left-padded decoder-only batch), a chunk of several new
queries on a KV cache (L < S, where the mask builder writes the causal rows itself), float
and bool masks, a static cache, rotary positions with a left-padded batch's ``position_ids``,
MLA's decoupled rotary key (absorbed and expanded decoding), sparse heads with rotary
positions. Each call runs here with each backend in each precision its kernel takes; the ones
a backend's rules refuse are listed with the refusal they must give.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from harness import AUTOCAST, CUDA, Answers, FakeCuda, KernelRuleError, autocast, kernel_stubs

import multihead.attention.masks as masks
import multihead.attention.rotary as rotary
from multihead.attention import MultiHeadAttention
from multihead.attention.backends import BackendUnavailableError

pytestmark = pytest.mark.fake_cuda

B, E, H, G = 3, 64, 4, 2  # head size 16 (FlexAttention's least on CUDA); grouped K/V heads
MEMORY = 6  # cross-attention keys
MAX_LEN = 8  # a static cache's buffer


class Step(NamedTuple):
    """One call of the layer: its output, its query length and the ``(L, S)`` of each
    kernel call it makes, as the kernel sees them."""

    out: torch.Tensor
    length: int
    kernels: list[tuple[int, int]]


Steps = list[Step]


def _x(length: int) -> torch.Tensor:
    return torch.randn(B, length, E, device=CUDA)


def _padding(length: int) -> torch.Tensor:
    """``(B, length)`` True = padding. A fake tensor has no values: what is checked is where
    and in what dtype every tensor the mask makes lives, and that holds for any values."""
    return torch.zeros(B, length, dtype=torch.bool, device=CUDA)


def _left_positions(pad: torch.Tensor, length: int) -> torch.Tensor:
    """``(B, length)`` positions of the last ``length`` of the keys ``pad`` ``(B, S)``
    describes, counted from each row's first token (as HF makes ``position_ids`` for a
    left-padded batch)."""
    return ((~pad).long().cumsum(-1)[:, -length:] - 1).clamp(min=0)


def _kernels(layer: MultiHeadAttention, L: int, S: int) -> list[tuple[int, int]]:
    """``(L, S)`` of each kernel call one layer call makes: one, or with sparse heads the
    routed heads on ``C`` packed rows (``C = min(L, Answers.integer)``, the count the fake
    device answers) and then the shared heads."""
    if layer.design is None or layer.design.name != "moh":
        return [(L, S)]
    return [(min(L, SPARSE_ROWS), S), (L, S)]


def _full(*, cross: bool = False, positions: bool = False, **given: Callable | bool):
    """Attention from 5 positions to themselves, or to a memory of 6 (``cross``), with
    the ``given`` masks (each made on the fake device when the call runs); ``positions``:
    a left-padded batch's ``position_ids``."""

    def call(layer: MultiHeadAttention) -> Steps:
        kwargs = {k: v() if callable(v) else v for k, v in given.items()}
        if positions:
            kwargs["position_ids"] = _left_positions(_padding(5), 5)
        memory = _x(MEMORY) if cross else None
        S = MEMORY if cross else 5
        return [Step(layer(_x(5), memory, **kwargs), 5, _kernels(layer, 5, S))]

    return call


def _cached(
    *, static: bool, padding: bool, positions: bool = False, absorb: bool | None = None
) -> Callable[[MultiHeadAttention], Steps]:
    """Causal self-attention through a KV cache: a prefill of 4 positions, a chunk of 2
    (L = 2 < S = 6: the causal rows are written into the mask), then one step.
    ``positions``: each step's ``position_ids`` for a left-padded batch (else the layer
    counts them from the cache). ``absorb``: an MLA layer decodes in eval mode with the
    absorbed weights (True) or re-expands K and V from the latent (False)."""

    def call(layer: MultiHeadAttention) -> Steps:
        if absorb is not None:
            layer.eval()  # MLA absorbs only outside training
            layer.design.absorb = absorb
        cache = layer.make_kv_cache(B, MAX_LEN, static=static)
        steps, seen = [], 0
        with torch.no_grad():
            for length in (4, 2, 1):
                seen += length
                keys = MAX_LEN if static else seen  # a static cache attends over its buffer
                pad = _padding(keys) if padding or positions else None
                kwargs = {"key_padding_mask": pad if padding else None}
                if positions:
                    kwargs["position_ids"] = _left_positions(pad[:, :seen], length)
                out = layer(_x(length), is_causal=True, kv_cache=cache, **kwargs)
                steps.append(Step(out, length, _kernels(layer, length, keys)))
        return steps

    return call


def _cached_cross(layer: MultiHeadAttention) -> Steps:
    """Cross-attention through a cache: the memory projected at the first step, then read."""
    cache = layer.make_kv_cache(B, MEMORY)
    memory, pad = _x(MEMORY), _padding(MEMORY)
    with torch.no_grad():
        return [
            Step(layer(_x(1), memory, key_padding_mask=pad, kv_cache=cache), 1, [(1, MEMORY)])
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
    # Rotary positions (self-attention only): positions from the cache's length, or a
    # left-padded batch's position_ids; the half-split pairing, partial and interleaved.
    "rope_causal": _full(is_causal=True),
    "rope_left_padded": _full(is_causal=True, key_padding_mask=lambda: _padding(5), positions=True),
    "rope_interleaved_left_padded": _full(
        is_causal=True, key_padding_mask=lambda: _padding(5), positions=True
    ),
    "rope_cached": _cached(static=False, padding=False),
    "rope_static_cached": _cached(static=True, padding=False),
    "rope_cached_left_padded": _cached(static=False, padding=True, positions=True),
    "rope_static_cached_left_padded": _cached(static=True, padding=True, positions=True),
    # MLA's decoupled rotary key, cached beside the latent.
    "mla_rope_absorbed": _cached(static=False, padding=False, absorb=True),
    "mla_rope_absorbed_left_padded": _cached(
        static=False, padding=True, positions=True, absorb=True
    ),
    "mla_rope_static_absorbed_left_padded": _cached(
        static=True, padding=True, positions=True, absorb=True
    ),
    "mla_rope_expanded_left_padded": _cached(
        static=False, padding=True, positions=True, absorb=False
    ),
    "mla_rope_static_expanded_left_padded": _cached(
        static=True, padding=True, positions=True, absorb=False
    ),
    # A rotary layer converted to MLA (with_kv_latent(rope_dim=...)): narrower Q/K, its own
    # scale, a rotary key per K/V group with explicit frequencies, one row per group.
    "mla_grouped_rope_absorbed_left_padded": _cached(
        static=False, padding=True, positions=True, absorb=True
    ),
    "mla_grouped_rope_static_expanded_left_padded": _cached(
        static=True, padding=True, positions=True, absorb=False
    ),
    # Sparse heads: each routed query rotated at its token's position, in packed rows.
    "moh_rope_left_padded": _full(
        is_causal=True, key_padding_mask=lambda: _padding(5), positions=True
    ),
    "moh_rope_cached_left_padded": _cached(static=False, padding=True, positions=True),
}

# The layer each call runs on: GQA by default. Head size 16: rotary_dim 8 is partial rotary.
GQA: dict[str, Any] = {"num_kv_heads": G}
ROPE = {**GQA, "rotary_dim": 8}
LAYERS: dict[str, dict[str, Any]] = {
    **{call: ROPE for call in CALLS if call.startswith("rope_")},
    "rope_interleaved_left_padded": {**GQA, "rotary_dim": 16, "rope_interleaved": True},
    **{
        call: {"design": "mla", "kv_latent_dim": 16, "rotary_dim": 8}
        for call in CALLS
        if call.startswith("mla_")
    },
    **{
        call: {
            "design": "mla",
            "kv_latent_dim": 16,
            "rotary_dim": 4,
            "qk_head_dim": 12,
            "softmax_scale": 0.25,
            "rope_kv_heads": G,
            "rope_inv_freq": [[1.0, 0.01], [0.1, 0.001]],
        }
        for call in CALLS
        if call.startswith("mla_grouped_")
    },
    **{
        call: {**ROPE, "design": "moh", "top_k_heads": 2, "num_shared_heads": 1}
        for call in CALLS
        if "moh" in call
    },
}
# Sparse heads read back how many rows the most-chosen head has (C): the fake device answers
# 2, so the routed heads run packed rows (C > 1), whose causal mask is written out.
SPARSE_ROWS = 2

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
    **{("flash", call): _NO_MASK for call in CALLS if call not in ("causal", "rope_causal")},
    ("flash_attn", "causal_padding"): _NO_CAUSAL_PADDING,
    ("flash_attn", "bool_mask"): _NO_ATTN_MASK,
    ("flash_attn", "float_mask"): _NO_ATTN_MASK,
    ("flash_attn", "causal_padding_float_mask"): _NO_ATTN_MASK,
    ("flash_attn", "cached_causal_padding"): _NO_CAUSAL_PADDING,
    ("flash_attn", "static_cached_causal"): _NO_ATTN_MASK,
    ("flash_attn", "static_cached_causal_padding"): _NO_ATTN_MASK,
    **{
        ("flash_attn", call): _NO_CAUSAL_PADDING
        for call in CALLS
        if call.endswith("left_padded") and "static" not in call and "moh" not in call
    },
    **{("flash_attn", call): _NO_ATTN_MASK for call in CALLS if "static" in call},
    # Sparse heads' packed rows carry their causal mask written out: an attn_mask.
    ("flash_attn", "moh_rope_left_padded"): _NO_ATTN_MASK,
    ("flash_attn", "moh_rope_cached_left_padded"): _NO_ATTN_MASK,
}


def run_call(call: str, backend: str, precision: str) -> tuple[Steps, list[str]]:
    """``CALLS[call]`` on a layer with ``backend`` on the fake device; the steps and the
    fused kernels called."""
    fake = FakeCuda(Answers(integer=SPARSE_ROWS))
    with kernel_stubs() as kernels:  # flash-attn's stand-in must be there when it is built
        torch.manual_seed(0)
        layer = MultiHeadAttention(E, H, backend=backend, **LAYERS.get(call, GQA))
        layer = fake.model(layer).train()
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
    for step in steps:
        assert (step.out.device, step.out.dtype, step.out.shape) == (
            CUDA,
            dtype,
            (B, step.length, E),
        )
    # Every call reached the named kernel, but cuDNN's length-1 calls (the written-out
    # formula, backends.py); math and sdpa go through PyTorch's own dispatcher.
    fused = backend not in ("math", "sdpa")
    shapes = [shape for step in steps for shape in step.kernels]
    want = [backend for L, S in shapes if fused and not (backend == "cudnn" and 1 in (L, S))]
    assert kernels == want


def planted(module: types.ModuleType, line: str, bug: str, monkeypatch) -> types.ModuleType:
    """A copy of ``module`` with its one ``line`` replaced by ``bug``."""
    source = Path(module.__file__).read_text()
    assert source.count(line) == 1, f"{module.__name__} no longer has {line!r}: plant the bug anew"
    copy = types.ModuleType(f"planted_{module.__name__.rpartition('.')[2]}")
    monkeypatch.setitem(sys.modules, copy.__name__, copy)  # dataclasses look it up
    exec(compile(source.replace(line, bug), module.__file__, "exec"), copy.__dict__)
    return copy


@pytest.mark.parametrize("call", ["causal_padding", "cached_causal_padding"])
def test_a_cpu_tensor_in_the_causal_rows_fails(monkeypatch, call: str) -> None:
    # The bug of issue 50: the causal rows' arange in masks.py without its device.
    run_call(call, "sdpa", "bf16")  # passes as the code is
    original = masks.build_attention_mask
    bug = planted(masks, "torch.arange(q_len, device=device)", "torch.arange(q_len)", monkeypatch)
    for name, module in list(sys.modules.items()):  # wherever the layer's code holds it
        if name.startswith("multihead.") and (
            getattr(module, "build_attention_mask", None) is original
        ):
            monkeypatch.setattr(module, "build_attention_mask", bug.build_attention_mask)
    with pytest.raises(RuntimeError, match="cuda:0 and cpu"):
        run_call(call, "sdpa", "bf16")


@pytest.mark.parametrize(
    "call", ["rope_cached", "rope_static_cached_left_padded", "mla_rope_absorbed_left_padded",
             "mla_grouped_rope_absorbed_left_padded", "moh_rope_left_padded"],
)  # fmt: skip
def test_a_cpu_tensor_in_the_rotary_angles_fails(monkeypatch, call: str) -> None:
    # The rotary frequencies made on the default device: cos/sin mix cuda:0 with the CPU.
    run_call(call, "sdpa", "bf16")  # passes as the code is
    line = "self.frequencies(positions.device, work)"
    bug = planted(rotary, line, "self.frequencies(None, work)", monkeypatch)
    monkeypatch.setattr(rotary.RotaryPositions, "cos_sin", bug.RotaryPositions.cos_sin)
    with pytest.raises(RuntimeError, match="cuda:0 and cpu"):
        run_call(call, "sdpa", "bf16")
