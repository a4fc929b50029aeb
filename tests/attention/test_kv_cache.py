"""Incremental decoding through the KV cache equals one full pass."""

import copy

import pytest
import torch

from multihead import KVCache, MultiHeadAttention

from helpers.models import HEAD_DESIGNS

E, H = 32, 4
B, L, S = 2, 7, 5
BACKENDS = ["math", "sdpa", "flash"]
GATE = torch.tensor([0.0, 1.7, -0.4, 1.0])  # a per-head gate: off, boosted, negative, kept

# Every design the layer builds, as its keyword arguments. ``absorb`` (latent attention:
# decode over the latent, absorbed, or re-expand K and V) and ``head_mask`` (the gate above)
# are set on the built layer.
PLAIN = {
    f"{backend}-{kind}": {"backend": backend, "num_kv_heads": G}
    for backend in BACKENDS
    for kind, G in (("mha", None), ("gqa", 2), ("mqa", 1))
}
DESIGNS = {
    **PLAIN,
    **HEAD_DESIGNS,  # sparse heads (MoH) and the head mixings
    # latent attention: the absorbed path against the expanded full pass, and expanded alone
    **{
        f"mla-{backend}-{'absorbed' if absorb else 'expanded'}": {
            "design": "mla",
            "kv_latent_dim": 12,
            "backend": backend,
            "absorb": absorb,
        }
        for backend in ("math", "sdpa")
        for absorb in (True, False)
    },
    # gated heads (head_mask); for latent attention the gate on the absorbed latent heads
    # against the gate on the expanded ones
    "gated-mha": {"head_mask": GATE},
    "gated-gqa": {"num_kv_heads": 2, "head_mask": GATE},
    "gated-mqa": {"num_kv_heads": 1, "head_mask": GATE},
    "gated-moh-k2": {"design": "moh", "top_k_heads": 2, "head_mask": GATE},
    "gated-moh-k1s2-gqa": {
        "design": "moh",
        "top_k_heads": 1,
        "num_shared_heads": 2,
        "num_kv_heads": 2,
        "head_mask": GATE,
    },
    "gated-talking_heads": {"design": "talking_heads", "backend": "math", "head_mask": GATE},
    "gated-mla": {"design": "mla", "kv_latent_dim": 12, "head_mask": GATE},
}


def build(design: str) -> MultiHeadAttention:
    """The design's layer in eval mode, with random biases and mixings far from the identity,
    so that each term shows."""
    options = dict(DESIGNS[design])
    absorb, head_mask = options.pop("absorb", None), options.pop("head_mask", None)
    torch.manual_seed(0)
    layer = MultiHeadAttention(E, H, **options).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("bias") or name.startswith("head_mix"):
                p.normal_(0.0, 0.5)
    if absorb is not None:
        layer.design.absorb = absorb
    layer.head_mask = head_mask
    return layer


def full_pass_reference(layer: MultiHeadAttention) -> MultiHeadAttention:
    """The layer whose full pass the cached one must equal: itself, or for a gated layer its
    ungated copy with head ``h``'s columns of ``W^O`` scaled by ``gate[h]`` (the gate written
    on the weights, as in tests/attention/test_head_mask.py)."""
    if layer.head_mask is None:
        return layer
    ref = copy.deepcopy(layer)
    ref.head_mask = None
    with torch.no_grad():
        ref.out_proj.weight.view(E, H, E // H).mul_(layer.head_mask.view(1, H, 1))
    return ref


@pytest.mark.parametrize("design", DESIGNS)
def test_incremental_decoding_equals_the_full_pass(design):
    """A decoder's use, one token at a time: causal self-attention through one cache, then
    cross-attention to a padded memory through another, equal the two full passes."""
    layer = build(design)
    x, memory = torch.randn(B, L, E), torch.randn(B, S, E)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, -2:] = True
    self_cache = layer.make_kv_cache(batch_size=B, max_len=L)
    cross_cache = layer.make_kv_cache(batch_size=B, max_len=S)
    with torch.no_grad():
        hidden, steps = [], []
        for t in range(L):
            hidden.append(layer(x[:, t : t + 1], is_causal=True, kv_cache=self_cache))
            # After the first step a different memory must change nothing: K/V come from the
            # cache (checked for the plain designs).
            mem = memory if t == 0 or design not in PLAIN else torch.randn(B, S, E)
            steps.append(layer(hidden[-1], mem, key_padding_mask=pad, kv_cache=cross_cache))
        ref = full_pass_reference(layer)
        full_hidden = ref(x, is_causal=True)
        full = ref(full_hidden, memory, key_padding_mask=pad)
    rtol = 1e-5 if design.startswith("mla-") else 1e-4
    torch.testing.assert_close(torch.cat(hidden, dim=1), full_hidden, atol=1e-5, rtol=rtol)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=rtol)
    if design in PLAIN:
        assert self_cache.size == L and cross_cache.size == S
        G = DESIGNS[design]["num_kv_heads"] or H
        assert self_cache.k.shape == (B, G, L, E // H)  # only G heads are stored


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_then_decode_equals_causal_pass(backend):
    torch.manual_seed(0)
    layer = MultiHeadAttention(E, H, 2, backend=backend).eval()
    x = torch.randn(B, L, E)
    cache = layer.make_kv_cache(B, L)
    with torch.no_grad():
        prefix = layer(x[:, :4], is_causal=True, kv_cache=cache)
        chunk = layer(x[:, 4:6], is_causal=True, kv_cache=cache)  # L < S: bottom-right causal
        last = layer(x[:, 6:], is_causal=True, kv_cache=cache)
        full = layer(x, is_causal=True)
    torch.testing.assert_close(torch.cat([prefix, chunk, last], 1), full, atol=1e-5, rtol=1e-4)


def test_cross_attention_projects_memory_once(monkeypatch):
    torch.manual_seed(0)
    layer = MultiHeadAttention(E, H, 1).eval()  # K/V rows (2*D) differ from Q rows (E)
    x, memory = torch.randn(B, L, E), torch.randn(B, S, E)
    cache = layer.make_kv_cache(B, S)
    projected_rows = []
    linear = torch.nn.functional.linear

    def counting_linear(inp, weight, bias=None):
        projected_rows.append(weight.shape[0])
        return linear(inp, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", counting_linear)
    with torch.no_grad():
        for t in range(L):
            layer(x[:, t : t + 1], memory, kv_cache=cache)
    kv_rows = 2 * 1 * (E // H)
    assert projected_rows.count(kv_rows) == 1  # K/V of the memory: once, on the first step
    assert projected_rows.count(E) == 2 * L  # Q and the output projection: every step


def test_decode_under_bf16_autocast():
    torch.manual_seed(0)
    layer = MultiHeadAttention(E, H, 1).eval()
    x = torch.randn(B, L, E)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cache = layer.make_kv_cache(B, L)
        steps = [layer(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(L)]
        full = layer(x, is_causal=True)
    assert cache.k.dtype == torch.bfloat16
    torch.testing.assert_close(torch.cat(steps, 1).float(), full.float(), atol=3e-2, rtol=3e-2)


def test_cache_bytes_select_reset_and_overflow():
    layer = MultiHeadAttention(E, H, 1)
    cache = layer.make_kv_cache(3, 4)
    assert isinstance(cache, KVCache)
    k = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 1, 2, E // H)
    cache.update(k, k)
    assert cache.size == 2
    assert cache.nbytes() == 2 * layer.kv_cache_bytes_per_token() * 3
    assert layer.kv_cache_bytes_per_token() == 2 * 1 * (E // H) * 4
    cache.select(torch.tensor([2, 0]))
    assert cache.batch_size == 2
    assert cache.get()[0][:, 0, 0, 0].tolist() == [2.0, 0.0]
    with pytest.raises(ValueError, match=r"holds 2 of 4 positions, cannot add 3"):
        cache.update(torch.zeros(2, 1, 3, E // H), torch.zeros(2, 1, 3, E // H))
    cache.reset()
    assert cache.size == 0 and cache.get()[0].shape[2] == 0


@pytest.mark.parametrize(
    "design",
    [
        {"backend": "math"},
        {"backend": "sdpa"},
        {"design": "moh", "top_k_heads": 2, "num_shared_heads": 1},
        {"design": "talking_heads", "backend": "math"},
        {"design": "group_mlp"},
    ],
)
def test_static_cache_decoding_equals_full_pass(design):
    # The static cache returns all max_len positions; the layer hides the ones not written
    # yet and, for causal attention, the ones after each query. Chunks of 3, 2, 1, 1.
    torch.manual_seed(0)
    layer = MultiHeadAttention(E, H, 2, **design).eval()
    x, memory = torch.randn(B, L, E), torch.randn(B, S, E)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, -2:] = True
    self_cache = layer.make_kv_cache(B, L + 3, static=True)  # 3 positions never written
    cross_cache = layer.make_kv_cache(B, S, static=True)
    with torch.no_grad():
        steps = []
        for chunk in (x[:, :3], x[:, 3:5], x[:, 5:6], x[:, 6:]):
            h = layer(chunk, is_causal=True, kv_cache=self_cache)
            steps.append(layer(h, memory, key_padding_mask=pad, kv_cache=cross_cache))
        full = layer(layer(x, is_causal=True), memory, key_padding_mask=pad)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)
    assert int(self_cache.position) == L and int(cross_cache.position) == S
    assert self_cache.get()[0].shape[2] == L + 3


def test_static_cache_overflow_and_reset():
    cache = KVCache(1, 3, 1, E // H, static=True)
    k = torch.randn(1, 1, 3, E // H)
    cache.update(k, k)
    with pytest.raises(IndexError, match=r"index 3 is out of bounds"):
        cache.update(k[:, :, :1], k[:, :, :1])
    cache.reset()
    assert cache.size == 0 and int(cache.position) == 0
    cache.update(k[:, :, :1], 2 * k[:, :, :1])
    torch.testing.assert_close(cache.get()[1][:, :, 0], 2 * k[:, :, 0])
