"""Sparse heads (MoH) and head mixings against written-out loops over heads and tokens."""

import copy
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from multihead import MultiHeadAttention
from multihead.attention import with_kv_heads

from helpers.models import HEAD_DESIGNS as DESIGNS

E, H = 32, 4
D = E // H
B, L, S = 2, 6, 9


def build(design: str, **overrides) -> MultiHeadAttention:
    """A layer with random biases and mixings far from the identity, so each term shows."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(E, H, **{**DESIGNS[design], **overrides})
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("bias") or name.startswith("head_mix"):
                p.normal_(0.0, 0.5)
    return layer.eval()


def masks(kind: str, kv_len: int) -> dict:
    pad = torch.zeros(B, kv_len, dtype=torch.bool)
    pad[1, -2:] = True
    per_head = torch.rand(H, L, kv_len, generator=torch.Generator().manual_seed(3)) < 0.4
    per_head[:, :, 0] = False  # every row keeps a key
    return {
        "causal": {"is_causal": True},
        "causal+padding": {"is_causal": True, "key_padding_mask": pad},
        "padding": {"key_padding_mask": pad},
        "per-head": {"attn_mask": per_head},
    }[kind]


# --------------------------------------------------------------------------- references
def project_head(layer, x_t, src_b, h):
    """Head h's query for token x_t (D,), and its keys and values (S, D) over src_b."""
    w, bias = layer.in_proj.weight, layer.in_proj.bias
    G = layer.num_kv_heads
    g = h // (H // G)  # the K/V head that query head h reads
    q = w[h * D : (h + 1) * D] @ x_t + bias[h * D : (h + 1) * D]
    k_rows = slice(E + g * D, E + (g + 1) * D)
    v_rows = slice(E + G * D + g * D, E + G * D + (g + 1) * D)
    return q, src_b @ w[k_rows].T + bias[k_rows], src_b @ w[v_rows].T + bias[v_rows]


def head_output(layer, x_t, src, h, b, t, kwargs):
    """head_h for query token t of sentence b, written out: softmax(q.K^T / sqrt(D)) V."""
    q, keys, values = project_head(layer, x_t, src[b], h)
    scores = keys @ q / math.sqrt(D)  # (S,)
    p = torch.softmax(scores.masked_fill(~visible(b, t, src.shape[1], kwargs, h), float("-inf")), 0)
    return p @ values, p


def visible(b, t, kv_len, kwargs, h=0):
    """Keys that query t of sentence b, head h may see."""
    seen = torch.ones(kv_len, dtype=torch.bool)
    if kwargs.get("is_causal"):
        seen &= torch.arange(kv_len) <= t
    if "key_padding_mask" in kwargs:
        seen &= ~kwargs["key_padding_mask"][b]
    if "attn_mask" in kwargs:  # (H, L, S) bool, True = masked out
        seen &= ~kwargs["attn_mask"][h, t]
    return seen


def sparse_reference(layer, x, memory, kwargs):
    """MoH (Jin et al., 2024) literally: sum over shared heads, plus sum over TopK(G(x)) of
    softmax(G(x))_i * head_i, each head through its slice of W^O; and the weights."""
    src = x if memory is None else memory
    s = layer.head_config.get("num_shared_heads", 0)
    out = torch.zeros(B, L, E)
    weights = torch.zeros(B, H, L, src.shape[1])
    for b in range(B):
        for t in range(L):
            gate = layer.head_gate.weight @ x[b, t]  # (H - s,)
            chosen = sorted(range(H - s), key=lambda i: -gate[i].item())[
                : layer.head_config["top_k_heads"]
            ]
            norm = sum(math.exp(gate[i].item()) for i in chosen)
            scaled = [(h, 1.0) for h in range(s)]
            scaled += [(s + i, math.exp(gate[i].item()) / norm) for i in chosen]
            y = layer.out_proj.bias.clone()
            for h, factor in scaled:
                head, p = head_output(layer, x[b, t], src, h, b, t, kwargs)
                y += factor * (layer.out_proj.weight[:, h * D : (h + 1) * D] @ head)
                weights[b, h, t] = p
            out[b, t] = y
    return out, weights


def dense_heads(layer, x, kwargs, logit_mix=None, weight_mix=None):
    """All heads' outputs (B, L, H, D) and weights (B, H, L, L) written out, with
    talking-heads mixes if given."""
    heads, weights = torch.zeros(B, L, H, D), torch.zeros(B, H, L, L)
    for b in range(B):
        for t in range(L):
            logits, values = [], []
            for h in range(H):
                q, keys, head_values = project_head(layer, x[b, t], x[b], h)
                logits.append(keys @ q / math.sqrt(D))
                values.append(head_values)
            if logit_mix is not None:  # J'_j = sum_i J_i P_l[i, j]
                logits = [sum(logits[i] * logit_mix[i, j] for i in range(H)) for j in range(H)]
            seen = visible(b, t, L, kwargs)
            probs = [torch.softmax(lg.masked_fill(~seen, float("-inf")), 0) for lg in logits]
            if weight_mix is not None:  # W'_j = sum_i W_i P_w[i, j]
                probs = [sum(probs[i] * weight_mix[i, j] for i in range(H)) for j in range(H)]
            for h in range(H):
                heads[b, t, h] = probs[h] @ values[h]
                weights[b, h, t] = probs[h]
    return heads, weights


def project_out(layer, heads):
    return heads.reshape(B, L, E) @ layer.out_proj.weight.T + layer.out_proj.bias


# --------------------------------------------------------------------------- values
@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("mask_kind", ["causal", "causal+padding", "per-head"])
@pytest.mark.parametrize("design", [d for d in DESIGNS if d.startswith("moh")])
def test_sparse_heads_match_eq_5_3_12_self_attention(design, mask_kind, backend):
    layer = build(design, backend=backend)
    x = torch.randn(B, L, E)
    kwargs = masks(mask_kind, L)
    with torch.no_grad():
        expected, expected_weights = sparse_reference(layer, x, None, kwargs)
        torch.testing.assert_close(layer(x, **kwargs), expected, atol=1e-5, rtol=1e-4)
        out, weights = layer(x, need_weights=True, **kwargs)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    # Unselected heads' weights are zero; selected and shared heads' are their softmax.
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("design", [d for d in DESIGNS if d.startswith("moh")])
def test_sparse_heads_match_eq_5_3_12_cross_attention(design):
    layer = build(design)
    x, memory = torch.randn(B, L, E), torch.randn(B, S, E)
    kwargs = masks("padding", S)
    with torch.no_grad():
        expected, _ = sparse_reference(layer, x, memory, kwargs)
        torch.testing.assert_close(layer(x, memory, **kwargs), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("design", ["talking_heads", "talking_heads-gqa"])
def test_talking_heads_match_the_formula(design):
    layer = build(design)
    x = torch.randn(B, L, E)
    kwargs = masks("causal+padding", L)
    mix = layer.head_mix
    with torch.no_grad():
        heads, expected_weights = dense_heads(layer, x, kwargs, mix.logit_mix, mix.weight_mix)
        torch.testing.assert_close(
            layer(x, **kwargs), project_out(layer, heads), atol=1e-5, rtol=1e-4
        )
        _, weights = layer(x, need_weights=True, **kwargs)
    torch.testing.assert_close(weights, expected_weights, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("design", ["group_mlp", "group_mlp4-mqa"])
def test_group_mlp_matches_the_formula(design):
    layer = build(design)
    x = torch.randn(B, L, E)
    mix, groups = layer.head_mix, layer.head_config["mixing_groups"]
    width = E // groups
    with torch.no_grad():
        heads = dense_heads(layer, x, {"is_causal": True})[0].reshape(B, L, E)
        mixed = torch.zeros(B, L, E)
        for b in range(B):
            for t in range(L):
                for g in range(groups):  # x_g + W2 gelu(W1 x_g + b1) + b2, per group
                    x_g = heads[b, t, g * width : (g + 1) * width]
                    hidden = F.gelu(x_g @ mix.w1[g] + mix.b1[g])
                    mixed[b, t, g * width : (g + 1) * width] = x_g + hidden @ mix.w2[g] + mix.b2[g]
        expected = mixed @ layer.out_proj.weight.T + layer.out_proj.bias
        torch.testing.assert_close(layer(x, is_causal=True), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("design", ["head_attention", "head_attention-gqa"])
def test_head_attention_matches_the_formula(design):
    layer = build(design)
    x = torch.randn(B, L, E)
    proj = layer.head_mix.head_mix
    with torch.no_grad():
        heads, _ = dense_heads(layer, x, {"is_causal": True})
        mixed = torch.zeros_like(heads)
        for b in range(B):
            for t in range(L):
                qkv = [proj.weight @ heads[b, t, h] + proj.bias for h in range(H)]
                for i in range(H):  # o_i + sum_j softmax_j(q_i . k_j / sqrt(D)) v_j
                    scores = torch.stack([qkv[i][:D] @ qkv[j][D : 2 * D] for j in range(H)])
                    p = torch.softmax(scores / math.sqrt(D), dim=0)
                    mixed[b, t, i] = heads[b, t, i] + sum(p[j] * qkv[j][2 * D :] for j in range(H))
        torch.testing.assert_close(
            layer(x, is_causal=True), project_out(layer, mixed), atol=1e-5, rtol=1e-4
        )


@pytest.mark.parametrize("design", [d for d in DESIGNS if not d.startswith("moh")])
def test_mixings_start_as_the_identity(design):
    # Fresh mixings (identity mixes, zero second layer / value rows): the plain layer's output.
    options = {k: v for k, v in DESIGNS[design].items() if k not in ("design", "mixing_groups")}
    torch.manual_seed(0)
    mixed = MultiHeadAttention(E, H, **DESIGNS[design])
    torch.manual_seed(0)
    plain = MultiHeadAttention(E, H, **options)
    x = torch.randn(B, L, E)
    torch.testing.assert_close(mixed(x, is_causal=True), plain(x, is_causal=True))


@pytest.mark.parametrize("design", DESIGNS)
def test_bf16_autocast_trains(design):
    layer = build(design).train()
    x = torch.randn(B, L, E, requires_grad=True)
    pad = masks("padding", L)["key_padding_mask"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x, key_padding_mask=pad)
    assert out.dtype == torch.bfloat16
    with torch.no_grad():
        ref = layer.eval()(x, key_padding_mask=pad)
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.05)
    out.float().sum().backward()
    assert torch.isfinite(x.grad).all()


# --------------------------------------------------------------------------- aux loss
def test_aux_loss_by_hand():
    torch.manual_seed(0)
    layer = MultiHeadAttention(E, H, design="moh", top_k_heads=2, num_shared_heads=1).train()
    x = torch.randn(B, L, E)
    layer(x)
    R, tokens = H - 1, [x[b, t] for b in range(B) for t in range(L)]
    counts, prob_sums = [0] * R, [0.0] * R
    for token in tokens:
        gate = (layer.head_gate.weight @ token).tolist()
        for i in sorted(range(R), key=lambda i: -gate[i])[:2]:
            counts[i] += 1
        total = sum(math.exp(v) for v in gate)
        for i in range(R):
            prob_sums[i] += math.exp(gate[i]) / total
    f = [c / (len(tokens) * 2) for c in counts]
    P = [p / len(tokens) for p in prob_sums]
    expected = R * sum(fi * pi for fi, pi in zip(f, P, strict=True))
    assert layer.aux_loss.item() == pytest.approx(expected, rel=1e-5)
    layer.aux_loss.backward()  # it trains the gate
    assert layer.head_gate.weight.grad.abs().sum() > 0
    layer.eval()
    layer(x)
    assert layer.aux_loss is None
    assert MultiHeadAttention(E, H).train().aux_loss is None


def test_a_layer_with_an_aux_loss_can_be_copied_and_pickled():
    layer = MultiHeadAttention(E, H, design="moh", top_k_heads=2).train()
    layer(torch.randn(B, L, E))
    assert layer.aux_loss.grad_fn is not None
    copied = copy.deepcopy(layer)
    assert copied.aux_loss is None and layer.aux_loss is not None
    restored = pickle.loads(pickle.dumps(layer))
    assert torch.equal(restored.head_gate.weight, layer.head_gate.weight)


def test_aux_loss_is_one_for_a_uniform_gate_and_grows_with_imbalance():
    layer = MultiHeadAttention(E, H, design="moh", top_k_heads=1).train()
    x = torch.zeros(1, 4, E)
    x[0, :, 0] = torch.tensor([1.0, -1.0, 1.0, -1.0])
    with torch.no_grad():
        layer.head_gate.weight.zero_()  # P_i = 1/R whatever the ties pick: R * sum f_i / R = 1
    layer(x)
    assert layer.aux_loss.item() == pytest.approx(1.0, rel=1e-6)
    with torch.no_grad():
        layer.head_gate.weight[:, 0] = torch.tensor([3.0, 1.0, -1.0, -3.0])
    layer(x)  # x_0 = +1 picks head 0, x_0 = -1 picks head 3: f = (1/2, 0, 0, 1/2)
    p_plus = torch.softmax(torch.tensor([3.0, 1.0, -1.0, -3.0]), 0)
    P = (p_plus + p_plus.flip(0)) / 2  # half the tokens each way
    assert layer.aux_loss.item() == pytest.approx(4 * (0.5 * P[0] + 0.5 * P[3]).item(), rel=1e-6)
    assert layer.aux_loss.item() > 1.5


# --------------------------------------------------------------------------- skipped compute
@pytest.mark.parametrize("top_k", [2, 4])
def test_sparse_heads_compute_only_the_selected_pairs(top_k):
    # Forward FLOPs of the math path, counted by PyTorch, against the count written out:
    # K/V for every token; Q and W^O for M rows per head, M the most (token, head) pairs
    # any head got in the batch; scores and values for C slots per (sentence, head), C the
    # most tokens any (sentence, head) got. The dense layer does B * L and L for both.
    torch.manual_seed(0)
    heads, length, width, batch = 8, 64, 128, 2
    head_dim = width // heads
    dense = MultiHeadAttention(width, heads, backend="math")
    sparse = MultiHeadAttention(width, heads, backend="math", design="moh", top_k_heads=top_k)
    x = torch.randn(batch, length, width)
    with torch.no_grad():
        chosen = sparse.head_gate(x).topk(top_k, dim=-1).indices  # (B, L, k)
        C = max(int((chosen[b] == h).sum()) for b in range(batch) for h in range(heads))
        M = max(int((chosen == h).sum()) for h in range(heads))
        counted = {}
        for name, layer in (("dense", dense), ("sparse", sparse)):
            with FlopCounterMode(display=False) as counter:
                layer(x, is_causal=True)
            counted[name] = counter.get_total_flops()
    tokens = batch * length
    expected_sparse = (
        2 * tokens * width * 2 * width  # K and V projections
        + 2 * tokens * width * heads  # the gate
        + 2 * heads * M * width * head_dim * 2  # Q rows and W^O columns of the selected heads
        + 2 * batch * heads * C * length * head_dim * 2  # their scores and weighted values
    )
    expected_dense = 2 * tokens * width * 4 * width + 2 * batch * heads * length**2 * head_dim * 2
    assert counted["dense"] == expected_dense
    assert counted["sparse"] == expected_sparse
    assert M < 1.3 * tokens * top_k / heads  # close to the balanced share
    assert counted["sparse"] < counted["dense"]


def test_unselected_heads_do_not_touch_the_output():
    layer = build("moh-k1s1")
    x = torch.randn(B, L, E)
    x[..., 0] = x[..., 0].abs() + 1.0
    with torch.no_grad():
        layer.head_gate.weight[0] = 0.0
        layer.head_gate.weight[0, 0] = -10.0  # routed head 0 (head 1) always loses
        assert (layer.head_gate(x).argmax(-1) != 0).all()
        before = layer(x)
        layer.in_proj.weight[D : 2 * D].normal_()  # head 1's W^Q rows
        layer.out_proj.weight[:, D : 2 * D].normal_()  # its slice of W^O
        assert torch.equal(layer(x), before)


# --------------------------------------------------------------------------- defaults
def test_defaults_are_the_plain_layer_bit_for_bit():
    # Same RNG draws at init, same state_dict keys, same output as the written-out layer:
    # one fused in_proj GEMM, SDPA, out_proj.
    torch.manual_seed(0)
    layer = MultiHeadAttention(E, H, 2)
    after_layer = torch.rand(4)
    torch.manual_seed(0)
    in_proj, out_proj = nn.Linear(E, E + 2 * 2 * D), nn.Linear(E, E)
    nn.init.uniform_(in_proj.weight, -((6 / (4 * E)) ** 0.5), (6 / (4 * E)) ** 0.5)
    nn.init.zeros_(in_proj.bias)
    nn.init.zeros_(out_proj.bias)
    assert torch.equal(torch.rand(4), after_layer)
    assert list(layer.state_dict()) == [
        "in_proj.weight",
        "in_proj.bias",
        "out_proj.weight",
        "out_proj.bias",
    ]
    assert torch.equal(layer.in_proj.weight, in_proj.weight)
    assert torch.equal(layer.out_proj.weight, out_proj.weight)
    x = torch.randn(B, L, E)
    q, k, v = in_proj(x).split([E, 2 * D, 2 * D], dim=-1)
    q = q.view(B, L, H, D).transpose(1, 2)
    k, v = (t.view(B, L, 2, D).transpose(1, 2) for t in (k, v))
    heads = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected = out_proj(heads.transpose(1, 2).reshape(B, L, E))
    assert torch.equal(layer(x, is_causal=True), expected)
    assert layer.head_tag == "gqa4kv2" and layer.active_head_fraction == 1.0
    assert layer.design is None and dict(layer.named_children()).keys() == {"in_proj", "out_proj"}


def test_head_design_names_and_active_fraction():
    names = {d: MultiHeadAttention(E, H, **o).head_tag for d, o in DESIGNS.items()}
    assert names["moh-k2"] == "mha4-moh-k2"
    assert names["moh-k2s1-gqa"] == "gqa4kv2-moh-k2s1"
    assert names["talking_heads"] == "mha4-talking_heads"
    assert names["group_mlp"] == "mha4-group_mlp2"
    assert names["group_mlp4-mqa"] == "mqa4-group_mlp4"
    assert names["head_attention-gqa"] == "gqa4kv2-head_attention"
    config = MultiHeadAttention(
        E, H, 2, design="moh", top_k_heads=2, num_shared_heads=1
    ).head_config
    assert config == {
        "kind": "gqa",
        "num_heads": H,
        "num_kv_heads": 2,
        "design": "moh",
        "top_k_heads": 2,
        "num_shared_heads": 1,
    }
    moh = MultiHeadAttention(E, 8, design="moh", top_k_heads=2, num_shared_heads=1)
    assert moh.active_head_fraction == 3 / 8
    assert MultiHeadAttention(E, H, design="group_mlp").active_head_fraction == 1.0


@pytest.mark.parametrize("design", DESIGNS)
def test_with_kv_heads_keeps_the_design(design):
    # From H K/V heads, so that pooling to one is a change (to its own count it is refused).
    layer = build(design, num_kv_heads=H)
    pooled = with_kv_heads(layer, 1)
    assert pooled.head_tag.split("-", 1)[1] == layer.head_tag.split("-", 1)[1]
    for name in ("head_gate", "head_mix"):
        if hasattr(layer, name):
            for a, b in zip(
                getattr(layer, name).parameters(), getattr(pooled, name).parameters(), strict=True
            ):
                assert torch.equal(a, b)


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"design": "moh", "top_k_heads": 5}, r"top_k_heads must be in \[1, 4\].*top_k_heads=5"),
        ({"design": "moh", "top_k_heads": 0}, r"top_k_heads must be in \[1, 4\].*top_k_heads=0"),
        (
            {"design": "moh", "top_k_heads": 2, "num_shared_heads": 3},
            r"\[1, 1\].*num_shared_heads=3.*=2",
        ),
        (
            {"design": "moh", "top_k_heads": 1, "num_shared_heads": 4},
            r"num_shared_heads must be in \[0, 3\].*num_heads=4",
        ),
        ({"design": "nope"}, r"unknown head design 'nope'; registered: .*talking_heads, group_mlp"),
        ({"design": "talking_heads"}, r"'talking_heads' runs on backend math only.*'sdpa'"),
        (
            {"design": "talking_heads", "backend": "flash"},
            r"'talking_heads' runs on backend math only; got backend='flash'",
        ),
        ({"design": "group_mlp", "top_k_heads": 2}, r"'group_mlp' takes no option top_k_heads"),
        ({"design": "group_mlp", "mixing_groups": 3}, r"mixing_groups \(3\).*num_heads \(4\)"),
        ({"design": "moh", "top_k_heads": 2, "groups": 2}, r"'moh' takes no option groups;"),
        (
            {"design": "moh", "top_k_heads": 2, "num_shared_head": 1},
            r"'moh' takes no option num_shared_head \(closest: num_shared_heads\); its options",
        ),
        ({"design": "moh", "top_k_heads": None}, r"head design 'moh' needs option top_k_heads"),
        # A design's options come with its name: none chooses it, none is "off" without it.
        ({"top_k_heads": 2}, r"options top_k_heads are a head design's, and design= names no"),
        ({"num_shared_heads": 0}, r"options num_shared_heads are a head design's"),
    ],
)
def test_invalid_designs_raise(options, pattern):
    with pytest.raises(ValueError, match=pattern):
        MultiHeadAttention(E, H, **options)


def test_non_integer_top_k_raises():
    with pytest.raises(TypeError, match=r"top_k_heads must be an integer, got 2.0"):
        MultiHeadAttention(E, H, design="moh", top_k_heads=2.0)
