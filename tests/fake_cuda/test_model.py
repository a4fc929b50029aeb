"""Forward passes, attention maps and the KV cache on the fake cuda:0, for every head design,
every precision and every backend whose kernel contract can be stubbed."""

from __future__ import annotations

import pytest
import torch
from harness import (
    AUTOCAST,
    CUDA,
    DESIGNS,
    FakeCuda,
    KernelRuleError,
    autocast,
    kernel_stubs,
    model_on_cpu,
    padded,
)

from multihead.attention import MultiHeadAttention
from multihead.attention.backends import BACKENDS, BackendUnavailableError
from multihead.attention.masks import AttentionMask

pytestmark = pytest.mark.fake_cuda

# Backends with their kernel's precisions: the fused kernels SDPA pins and flash-attn take
# fp16/bf16 only (efficient takes fp32 too).
BACKEND_DTYPES = {
    "math": ["fp32", "fp16", "bf16"],
    "sdpa": ["fp32", "fp16", "bf16"],
    "efficient": ["fp32", "fp16", "bf16"],
    "cudnn": ["fp16", "bf16"],
    "flex": ["fp32", "bf16"],
    "flash_attn": ["fp16", "bf16"],
}


def _expected_activation_dtype(precision: str) -> torch.dtype:
    return AUTOCAST[precision] or torch.float32


@pytest.mark.parametrize("precision", AUTOCAST)
@pytest.mark.parametrize("design", DESIGNS)
def test_forward_every_design(design: str, precision: str) -> None:
    fake = FakeCuda()
    model = fake.model(model_on_cpu(**DESIGNS[design])).train()
    with fake, autocast(AUTOCAST[precision]):
        src, tgt = padded((3, 7), CUDA), padded((3, 5), CUDA)
        memory, pad = model.encode(src)
        logits = model(src, tgt)
        aux = model.aux_loss()
    # Post-LN: every sublayer ends in a LayerNorm, which autocast runs in fp32.
    assert memory.device == CUDA and memory.dtype == torch.float32
    assert pad.device == CUDA
    assert logits.shape == (3, 5, 48) and logits.dtype == _expected_activation_dtype(precision)
    assert (aux is not None) == (design == "moh")


@pytest.mark.parametrize("design", DESIGNS)
def test_attention_maps_and_kv_cache(design: str) -> None:
    fake = FakeCuda()
    model = fake.model(model_on_cpu(**DESIGNS[design])).eval()
    with fake, torch.no_grad(), autocast(torch.bfloat16):
        src, tgt = padded((2, 6), CUDA), padded((2, 4), CUDA)
        maps = model.attention_maps(src, tgt)
        memory, pad = model.encode(src)
        caches = model.make_decoder_cache(2, 4, 6)
        steps = [model.decode(tgt[:, t : t + 1], memory, pad, caches) for t in range(4)]
    assert [m.shape for m in maps["cross"]] == [(2, 4, 4, 6)] * 2
    assert all(m.device == CUDA for kind in maps.values() for m in kind)
    cache = caches.self_caches[0]
    assert (cache.k.device, cache.k.dtype, cache.size) == (CUDA, torch.bfloat16, 4)
    assert caches.cross_caches[0].k.dtype == torch.bfloat16
    assert all(s.shape == (2, 1, 48) and s.dtype == torch.bfloat16 for s in steps)


def _backend_cases():
    for backend, precisions in BACKEND_DTYPES.items():
        for precision in precisions:
            for heads in ("mha", "gqa"):
                yield backend, precision, heads


@pytest.mark.parametrize(("backend", "precision", "heads"), list(_backend_cases()))
def test_every_backend_meets_its_kernel_rules(backend: str, precision: str, heads: str) -> None:
    fake = FakeCuda()
    with kernel_stubs() as calls:  # flash-attn's stand-in must be there when the layer is built
        model = fake.model(model_on_cpu(backend=backend, **DESIGNS[heads])).train()
        with fake, autocast(AUTOCAST[precision]):
            states = model.decoder_states(padded((3, 7), CUDA), padded((3, 5), CUDA))
    assert states.device == CUDA
    kernel = {"math": None, "sdpa": None}.get(backend, backend)
    # Every attention call went to the named kernel: 2 encoder, 2 x 2 decoder sublayers.
    assert calls == ([kernel] * 6 if kernel else [])


def test_flash_refuses_a_padded_model_before_a_kernel_sees_the_mask() -> None:
    """SDPA's flash kernel takes no mask; the encoder always passes one."""
    fake = FakeCuda()
    with pytest.raises((BackendUnavailableError, ValueError), match="flash"):
        model = fake.model(model_on_cpu(backend="flash"))
        with fake, kernel_stubs(), autocast(torch.bfloat16):
            model.decoder_states(padded((2, 5), CUDA), padded((2, 3), CUDA))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_flash_runs_causal_self_attention_and_decoding_steps(precision: str) -> None:
    fake = FakeCuda()
    layer = fake.model(MultiHeadAttention(64, 4, num_kv_heads=2, backend="flash")).eval()
    with fake, torch.no_grad(), kernel_stubs() as calls, autocast(AUTOCAST[precision]):
        x = torch.randn(2, 5, 64, device=CUDA)
        full = layer(x, is_causal=True)
        cache = layer.make_kv_cache(2, 5)
        steps = [layer(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(5)]
    assert full.dtype == AUTOCAST[precision] and len(steps) == 5
    assert calls == ["flash"] * 6


def test_a_kernel_stub_refuses_what_its_kernel_refuses() -> None:
    """The stubs are checks: fp32 into flash-attn fails as the package would."""
    with kernel_stubs(), FakeCuda(), pytest.raises(KernelRuleError, match="flash_attn: dtype"):
        q = torch.randn(2, 4, 5, 16, device=CUDA)  # fp32
        BACKENDS["flash_attn"](q, q, q, AttentionMask(), 0.0, 0.25)
