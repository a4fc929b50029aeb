"""Differential attention against Hugging Face's ``DiffLlamaAttention`` (eager), and the formula.

The reference is HF's module given the same weights (Q/K/V/O and the four lambda vectors), in
fp64 at tiny sizes; HF computes its rotary angles in fp32, hence a tolerance of 1e-6 and not
less. Cached decoding is checked against the layer's own full pass, which the HF test pins.
"""

from __future__ import annotations

import math

import pytest
import torch

from multihead import MultiHeadAttention
from multihead.attention import with_kv_heads
from multihead.attention.differential import lambda_init_at

E, B, L = 32, 2, 6


def diff_layer(num_heads: int, num_kv_heads: int, *, lambda_init: float = 0.2, **options):
    """A layer with the differential design, in fp64 and eval mode."""
    torch.manual_seed(0)
    return MultiHeadAttention(
        E, num_heads, num_kv_heads, design="diff", lambda_init=lambda_init,
        dtype=torch.float64, **options,
    ).eval()  # fmt: skip


def hf_reference(layer: MultiHeadAttention, layer_idx: int):
    """HF's DiffLlamaAttention with ``layer``'s weights (eager), and its rotary embedding."""
    diffllama = pytest.importorskip("transformers.models.diffllama.modeling_diffllama")
    from transformers import DiffLlamaConfig

    H, G, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    config = DiffLlamaConfig(
        hidden_size=E, num_attention_heads=H, num_key_value_heads=G, rms_norm_eps=1e-5,
        attention_bias=layer.in_proj.bias is not None, attn_implementation="eager",
    )  # fmt: skip
    module = diffllama.DiffLlamaAttention(config, layer_idx=layer_idx).double().eval()
    q, k, v = layer.in_proj.weight.split([H * D, G * D, G * D])
    with torch.no_grad():
        for theirs, ours in [(module.q_proj, q), (module.k_proj, k), (module.v_proj, v)]:
            theirs.weight.copy_(ours)
        module.o_proj.weight.copy_(layer.out_proj.weight)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            getattr(module, name).copy_(getattr(layer.design, name))
    return module, diffllama.DiffLlamaRotaryEmbedding(config)


@pytest.mark.parametrize(("H", "G"), [(4, 4), (4, 2), (8, 2)], ids=["mha", "gqa4/2", "gqa8/2"])
def test_matches_hf_diffllama_attention(H: int, G: int) -> None:
    layer_idx = 3
    layer = diff_layer(H, G, lambda_init=lambda_init_at(layer_idx), bias=False, rotary_dim=E // H)
    layer.backend = "math"
    module, rotary = hf_reference(layer, layer_idx)
    assert module.lambda_init == layer.design.lambda_init  # the paper's schedule, by depth
    x = torch.randn(B, L, E, dtype=torch.float64)
    positions = torch.arange(L)[None].expand(B, L)
    causal = torch.full((L, L), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)
    expected, _ = module(x, rotary(x, positions), attention_mask=causal[None, None])
    for backend in ("math", "sdpa"):
        layer.backend = backend
        torch.testing.assert_close(layer(x, is_causal=True), expected, rtol=0, atol=1e-6)


def test_matches_the_formula_written_out() -> None:
    """One differential head by hand: (softmax(q1 k1) - lambda softmax(q2 k2)) [V1; V2]."""
    H, G, D = 2, 2, E // 2
    layer = diff_layer(H, G, lambda_init=0.5, bias=False)
    x = torch.randn(1, L, E, dtype=torch.float64)
    q1, q2, k1, k2, v1, v2 = (x @ w.T for w in layer.in_proj.weight.split(D))  # (1, L, D)
    p = layer.design.requires_grad_(False)
    lam = math.exp(p.lambda_q1 @ p.lambda_k1) - math.exp(p.lambda_q2 @ p.lambda_k2) + 0.5
    a1 = torch.softmax(q1 @ k1.mT / math.sqrt(D), -1)
    a2 = torch.softmax(q2 @ k2.mT / math.sqrt(D), -1)
    head = (a1 - lam * a2) @ torch.cat((v1, v2), -1)  # (1, L, 2D)
    head = head / (head.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * (1 - 0.5)
    torch.testing.assert_close(layer(x), head @ layer.out_proj.weight.T, rtol=0, atol=1e-12)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize(("H", "G"), [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_cached_decoding_equals_the_full_pass(H: int, G: int, static: bool) -> None:
    layer = diff_layer(H, G, rotary_dim=E // H)
    x = torch.randn(B, L, E, dtype=torch.float64)
    full = layer(x, is_causal=True)
    cache = layer.make_kv_cache(B, L, static=static)
    steps = [layer(x[:, :3], is_causal=True, kv_cache=cache)]  # a prompt, then one at a time
    steps += [layer(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(3, L)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-12)


def test_cross_attention_with_padding_matches_the_formula_per_sentence() -> None:
    """A padded memory gives each sentence what it gets alone, without its padding."""
    layer = diff_layer(4, 2)
    x, memory = torch.randn(B, L, E, dtype=torch.float64), torch.randn(B, 5, E, dtype=torch.float64)
    pad = torch.zeros(B, 5, dtype=torch.bool)
    pad[1, 3:] = True
    out = layer(x, memory, key_padding_mask=pad)
    torch.testing.assert_close(out[1:], layer(x[1:], memory[1:, :3]), rtol=0, atol=1e-12)


def test_weights_are_the_query_heads_maps() -> None:
    layer = diff_layer(4, 2)
    x = torch.randn(B, L, E, dtype=torch.float64)
    out, weights = layer(x, is_causal=True, need_weights=True)
    assert weights.shape == (B, 4, L, L)
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, 4, L, dtype=torch.float64))
    torch.testing.assert_close(out, layer(x, is_causal=True), rtol=0, atol=1e-12)


def test_lambda_init_follows_the_papers_depth_schedule() -> None:
    # Ye et al., section 2.1: lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1)), l = 1 .. L.
    assert [round(lambda_init_at(d), 4) for d in range(3)] == [0.2, 0.3555, 0.4707]


def test_head_mask_is_refused() -> None:
    x = torch.randn(B, L, E, dtype=torch.float64)
    with pytest.raises(ValueError, match="head_mask is undefined for head design 'diff'"):
        diff_layer(4, 2)(x, head_mask=torch.ones(4, dtype=torch.float64))


def test_tag_config_and_conversion_keep_the_design() -> None:
    layer = diff_layer(4, 4, lambda_init=0.5)
    # A lambda_init of its own is another model than the paper's by depth: another tag.
    assert MultiHeadAttention(E, 4, design="diff").head_tag == "mha4-diff"
    assert layer.head_tag.startswith("mha4-diff-")
    suffix = layer.head_tag.removeprefix("mha4-diff")
    assert layer.head_config == dict(
        kind="mha", num_heads=4, num_kv_heads=4, design="diff", lambda_init=0.5, norm_eps=1e-5
    )
    pooled = with_kv_heads(layer, 2)
    assert pooled.head_tag == f"gqa4kv2-diff{suffix}" and pooled.design.lambda_init == 0.5
    torch.testing.assert_close(pooled.design.lambda_q2, layer.design.lambda_q2, rtol=0, atol=0)
    assert MultiHeadAttention(E, 4, design="diff").design.lambda_init == lambda_init_at(0)


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"lambda_init": 0.5}, r"options lambda_init are a head design's, and design= names no"),
        ({"design": "diff", "top_k_heads": 2}, r"head design 'diff' takes no option top_k_heads"),
        ({"design": "diff", "num_kv_heads": 1}, r"even num_kv_heads.*num_kv_heads=1"),
    ],
)
def test_invalid_options_raise(options: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        MultiHeadAttention(E, 4, **options)


def test_head_analysis_refuses_differential_heads_by_name() -> None:
    """Each query head's map times V is not a differential head's output (two maps
    subtracted, over V of two K/V heads, normalised): head analysis refuses the design."""
    layer = MultiHeadAttention(E, 4, design="diff")
    weights, source = torch.rand(1, 4, 3, 3), torch.randn(1, 3, E)
    with pytest.raises(ValueError, match="'diff' gives no per-head outputs"):
        layer.head_outputs(weights, source)
