"""The per-head gate ``head_mask`` (Michel et al., 2019) and ``prune_heads``.

The reference for a gate ``g`` is the same layer with column block ``h`` of ``W^O`` scaled
by ``g_h``: what scaling head ``h``'s output before ``W^O`` means, written on the weights.
"""

import copy

import pytest
import torch

from multihead import MultiHeadAttention
from multihead.attention import prune_heads, with_kv_heads, with_kv_latent

E, H = 32, 4
D = E // H
B, L, S = 2, 6, 9

GATED = {
    "mha": {},
    "gqa": {"num_kv_heads": 2},
    "mqa": {"num_kv_heads": 1},
    "moh-k2": {"design": "moh", "top_k_heads": 2},
    "moh-k1s2-gqa": {"design": "moh", "top_k_heads": 1, "num_shared_heads": 2, "num_kv_heads": 2},
    "talking_heads": {"design": "talking_heads", "backend": "math"},
    "mla": {"design": "mla", "kv_latent_dim": 12},
}
GATE = torch.tensor([0.0, 1.7, -0.4, 1.0])


def build(options: dict) -> MultiHeadAttention:
    """A layer with random biases and talking-heads mixes far from the identity."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(E, H, **options).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("bias") or name.startswith("head_mix"):
                p.normal_(0.0, 0.5)
    return layer


def scaled_w_o(layer: MultiHeadAttention, gate: torch.Tensor) -> MultiHeadAttention:
    """A copy of ``layer`` with head ``h``'s columns of ``W^O`` multiplied by ``gate[h]``."""
    ref = copy.deepcopy(layer)
    ref.head_mask = None
    with torch.no_grad():
        ref.out_proj.weight.view(E, H, D).mul_(gate.view(1, H, 1))
    return ref


def inputs():
    torch.manual_seed(1)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, 5:] = True
    return torch.randn(B, L, E), torch.randn(B, S, E), pad


def run(layer, x, memory, pad, **kwargs):
    """Decoder-like use: causal self-attention, then cross-attention to ``memory``."""
    h = layer(x, is_causal=True, **kwargs)
    return layer(h, memory, key_padding_mask=pad, **kwargs)


# --------------------------------------------------------------------------- the gate
@pytest.mark.parametrize("design", GATED)
def test_no_gate_and_a_gate_of_ones_are_the_layer_bit_for_bit(design):
    layer = build(GATED[design])
    x, memory, pad = inputs()
    with torch.no_grad():
        plain = run(layer, x, memory, pad)
        ones = run(layer, x, memory, pad, head_mask=torch.ones(H))
        layer.head_mask = torch.ones(H)
        attribute = run(layer, x, memory, pad)
    assert torch.equal(plain, ones)
    assert torch.equal(plain, attribute)
    assert "head_mask" not in str(list(layer.state_dict()))


@pytest.mark.parametrize("design", GATED)
def test_gate_scales_each_heads_output_before_w_o(design):
    layer = build(GATED[design])
    ref = scaled_w_o(layer, GATE)
    x, memory, pad = inputs()
    with torch.no_grad():
        expected = run(ref, x, memory, pad)
        per_call = run(layer, x, memory, pad, head_mask=GATE)
        layer.head_mask = torch.zeros(H)  # the per-call gate wins over the attribute
        per_call_over_attribute = run(layer, x, memory, pad, head_mask=GATE)
        layer.head_mask = GATE
        attribute = run(layer, x, memory, pad)
    assert not torch.allclose(expected, run(build(GATED[design]), x, memory, pad))
    for out in (per_call, per_call_over_attribute, attribute):
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_gate_gradient_is_the_heads_contribution():
    # dL/dg_h for L = sum(out * c) is sum(c * (head_h W_O_h^T)): the head's own output term.
    layer = build({"num_kv_heads": 2})
    x, _, _ = inputs()
    c = torch.randn(B, L, E)
    gate = torch.ones(H, requires_grad=True)
    (layer(x, is_causal=True, head_mask=gate) * c).sum().backward()
    with torch.no_grad():
        zero_all = (layer(x, is_causal=True, head_mask=torch.zeros(H)) * c).sum()
        expected = [
            (layer(x, is_causal=True, head_mask=torch.eye(H)[h]) * c).sum() - zero_all
            for h in range(H)
        ]
    torch.testing.assert_close(gate.grad, torch.stack(expected), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mixing", ["group_mlp", "head_attention"])
def test_mixings_after_the_gate_refuse_it(mixing):
    layer = build({"design": mixing})
    x, _, _ = inputs()
    with pytest.raises(ValueError, match=f"head_mask is undefined for head design '{mixing}'"):
        layer(x, head_mask=torch.ones(H))
    layer.head_mask = torch.ones(H)
    with pytest.raises(ValueError, match=mixing):
        layer(x)


@pytest.mark.parametrize("bad", [torch.ones(H + 1), torch.ones(1, H), [1.0] * H])
def test_a_gate_of_the_wrong_shape_raises(bad):
    layer = build({})
    with pytest.raises(ValueError, match=r"head_mask must be a tensor of shape \(4,\)"):
        layer(torch.randn(B, L, E), head_mask=bad)


# --------------------------------------------------------------------------- pruning
@pytest.mark.parametrize(
    ("options", "heads", "kv_left"),
    [
        ({}, [1, 3], 2),
        ({"bias": False}, [0], 3),
        ({"num_kv_heads": 2}, [2, 3], 1),
        ({"num_kv_heads": 1}, [0, 2], 1),
    ],
    ids=["mha", "mha-nobias", "gqa", "mqa"],
)
def test_pruning_equals_masking_the_same_heads(options, heads, kv_left):
    layer = build(options)
    pruned = prune_heads(layer, heads)
    mask = torch.ones(H)
    mask[heads] = 0.0
    x, memory, pad = inputs()
    with torch.no_grad():
        masked = run(layer, x, memory, pad, head_mask=mask)
        cut = run(pruned, x, memory, pad)
        self_cache = pruned.make_kv_cache(batch_size=B, max_len=L)
        cross_cache = pruned.make_kv_cache(batch_size=B, max_len=S)
        steps = []
        for t in range(L):
            h = pruned(x[:, t : t + 1], is_causal=True, kv_cache=self_cache)
            steps.append(pruned(h, memory, key_padding_mask=pad, kv_cache=cross_cache))
    torch.testing.assert_close(cut, masked, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(steps, dim=1), masked, atol=1e-5, rtol=1e-4)
    assert (pruned.num_heads, pruned.num_kv_heads, pruned.head_dim) == (
        H - len(heads),
        kv_left,
        D,
    )
    removed = len(heads) * D * E * 2  # W^Q rows and W^O columns
    removed += (layer.num_kv_heads - kv_left) * D * E * 2  # K and V rows
    if layer.in_proj.bias is not None:
        removed += len(heads) * D + (layer.num_kv_heads - kv_left) * D * 2
    count = sum(p.numel() for p in layer.parameters())
    assert sum(p.numel() for p in pruned.parameters()) == count - removed
    assert layer.num_heads == H  # the input layer is left as it was


def test_pruning_keeps_a_gate_set_on_the_layer():
    layer = build({})
    layer.head_mask = GATE
    pruned = prune_heads(layer, [0])
    assert torch.equal(pruned.head_mask, GATE[1:])
    x, memory, pad = inputs()
    with torch.no_grad():
        torch.testing.assert_close(
            run(pruned, x, memory, pad), run(layer, x, memory, pad), atol=1e-5, rtol=1e-4
        )


@pytest.mark.parametrize(
    ("options", "heads", "pattern"),
    [
        ({"num_kv_heads": 2}, [1], r"GQA prunes whole groups of 2 query heads.*got heads \[1\]"),
        ({"num_kv_heads": 2}, [0, 1, 2], r"whole groups of 2"),
        ({}, [0, 1, 2, 3], "keep at least one of the 4 heads"),
        ({}, [4], r"head indices must be in \[0, 4\), got \[4\]"),
        (
            {"design": "moh", "top_k_heads": 2},
            [0],
            "a design that declares it; got head design 'mha4-moh-k2'",
        ),
        ({"design": "mla", "kv_latent_dim": 8}, [0], "got head design 'mla4r8'"),
        ({"design": "talking_heads", "backend": "math"}, [0], "talking_heads"),
    ],
)
def test_invalid_pruning_raises(options, heads, pattern):
    with pytest.raises(ValueError, match=pattern):
        prune_heads(build(options), heads)


def test_a_pruned_layer_refuses_the_conversions_that_assume_all_heads():
    pruned = prune_heads(build({}), [0, 1])
    with pytest.raises(ValueError, match="has pruned heads"):
        with_kv_heads(pruned, 1)
    with pytest.raises(ValueError, match="has pruned heads"):
        with_kv_latent(pruned, 4)


@pytest.mark.parametrize(
    ("embed_dim", "first", "second", "removed"),
    [(16, [0, 1], [0], [0, 1, 2]), (24, [3], [2], [2, 3])],
)
def test_pruning_twice_equals_masking_both_sets_of_heads(embed_dim, first, second, removed):
    """The second prune indexes the heads left by the first (head_dim stays E / 4)."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(embed_dim, 4).eval()
    twice = prune_heads(prune_heads(layer, first), second)
    mask = torch.ones(4)
    mask[removed] = 0.0
    x = torch.randn(B, L, embed_dim)
    assert (twice.num_heads, twice.head_dim) == (4 - len(removed), embed_dim // 4)
    with torch.no_grad():
        expected = layer(x, is_causal=True, head_mask=mask)
        torch.testing.assert_close(twice(x, is_causal=True), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("convert", ["with_kv_heads", "with_kv_latent"])
def test_kv_conversions_keep_the_head_mask(convert):
    """25fe9c2 dropped it (0.26 off at with_kv_heads(H)); both keep every query head. The
    K/V heads come in identical pairs, so that pooling them into 2 is exact."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4).eval()
    with torch.no_grad():
        kv = layer.in_proj.weight[16:].view(2, 2, 2, 4, 16)  # (K/V, pair, head, D, E)
        kv.copy_(kv[:, :, :1].expand_as(kv))
    layer.head_mask = torch.tensor([1.0, 0.0, 0.5, 1.0])
    new = with_kv_heads(layer, 2) if convert == "with_kv_heads" else with_kv_latent(layer, 16)
    x = torch.randn(2, 5, 16)
    assert new.head_mask is layer.head_mask
    with torch.no_grad():
        torch.testing.assert_close(
            new(x, is_causal=True), layer(x, is_causal=True), atol=1e-5, rtol=1e-5
        )
