"""Rotary positions: the rotation against a written-out reference and HF's own functions,
the layer's cached decoding and left padding, and its refusals."""

import cmath
import re

import pytest
import torch

from multihead import MultiHeadAttention
from multihead.attention import expand_latent, with_kv_latent
from multihead.attention.rotary import RotaryPositions


def reference_rotation(x, positions, rotary_dim, theta, interleaved):
    """Each feature pair as a complex number z, times e^(i p theta^(-2j/R)): the RoFormer
    paper's definition, one number at a time (fp64 Python complex arithmetic)."""
    out = x.clone()
    half = rotary_dim // 2
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in x.shape[:-1])):
        idx = tuple(idx.tolist())
        p = float(positions[idx[-1]])
        for j in range(half):
            a_at, b_at = (2 * j, 2 * j + 1) if interleaved else (j, j + half)
            z = complex(x[idx + (a_at,)], x[idx + (b_at,)])
            z *= cmath.exp(1j * p * theta ** (-2 * j / rotary_dim))
            out[idx + (a_at,)], out[idx + (b_at,)] = z.real, z.imag
    return out


@pytest.mark.parametrize(
    "rotary_dim, interleaved", [(8, False), (8, True), (4, False), (6, True)], ids=str
)
def test_rotation_equals_the_written_out_reference(rotary_dim, interleaved):
    torch.manual_seed(0)
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64)  # (B, heads, L, D)
    positions = torch.tensor([0, 1, 2, 7, 300])
    rope = RotaryPositions(8, rotary_dim=rotary_dim, theta=500.0, interleaved=interleaved)
    expected = reference_rotation(x, positions, rotary_dim, 500.0, interleaved)
    torch.testing.assert_close(rope.rotate(x, positions), expected, rtol=0, atol=1e-12)


def _hf_rotary(module_name, config_class, rotary_class, **config):
    modeling = pytest.importorskip(f"transformers.models.{module_name}.modeling_{module_name}")
    import transformers

    cfg = getattr(transformers, config_class)(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **config
    )
    return getattr(modeling, rotary_class)(cfg), modeling.apply_rotary_pos_emb


@pytest.mark.parametrize(
    "family, rotary_dim, interleaved",
    [
        # HF Llama: rotate half, every feature; theta as Llama 3.
        (("llama", "LlamaConfig", "LlamaRotaryEmbedding", {}), 16, False),
        # GPT-NeoX: rotate half of the first quarter of each head's features.
        (
            ("gpt_neox", "GPTNeoXConfig", "GPTNeoXRotaryEmbedding", {"rotary_pct": 0.25}),
            4,
            False,
        ),
        # Cohere: neighbouring pairs (the RoFormer paper's and Meta's original Llama's).
        (("cohere", "CohereConfig", "CohereRotaryEmbedding", {}), 16, True),
    ],
    ids=["llama", "gpt_neox_partial", "cohere_interleaved"],
)
def test_rotation_equals_hugging_face(family, rotary_dim, interleaved):
    module_name, config_class, rotary_class, extra = family
    theta = 500000.0
    hf_rope, hf_apply = _hf_rotary(
        module_name, config_class, rotary_class, rope_parameters={"rope_type": "default",
        "rope_theta": theta, **({"partial_rotary_factor": 0.25} if "rotary_pct" in extra else {})},
    )  # fmt: skip
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16)  # (B, H, L, D), (B, G, L, D)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]])  # left-padded row
    cos, sin = hf_rope(q, position_ids)
    hf_q, hf_k = hf_apply(q, k, cos, sin)
    ours = RotaryPositions(16, rotary_dim=rotary_dim, theta=theta, interleaved=interleaved)
    torch.testing.assert_close(ours.rotate(q, position_ids), hf_q, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.rotate(k, position_ids), hf_k, rtol=0, atol=1e-6)


DESIGNS = {
    "mha": {},
    "gqa": {"num_kv_heads": 2},
    "mqa": {"num_kv_heads": 1},
    "moh": {"design": "moh", "top_k_heads": 2, "num_shared_heads": 1},
    "talking_heads": {"design": "talking_heads", "backend": "math"},
}


@pytest.mark.parametrize("static", [False, True], ids=["cache", "static_cache"])
@pytest.mark.parametrize("design", list(DESIGNS))
def test_cached_decoding_with_rotary_equals_the_full_pass(static, design):
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4, rotary_dim=6, rope_interleaved=True, **DESIGNS[design])
    attn = attn.eval()
    x = torch.randn(2, 7, 32)
    full = attn(x, is_causal=True)
    cache = attn.make_kv_cache(2, 8, static=static)
    prefix = attn(x[:, :3], is_causal=True, kv_cache=cache)  # a prefill of 3, then steps
    steps = [attn(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(3, 7)]
    torch.testing.assert_close(torch.cat([prefix, *steps], 1), full, rtol=0, atol=1e-5)
    # The positions are applied: without them the same weights give another output.
    plain = MultiHeadAttention(32, 4, **DESIGNS[design]).eval()
    plain.load_state_dict(attn.state_dict())
    assert (plain(x, is_causal=True) - full).abs().max() > 1e-3


def test_left_padded_rows_with_their_own_positions_equal_the_unpadded_rows():
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4, 2, rotary_dim=8).eval()
    x = torch.randn(2, 5, 32)
    padded = torch.cat([torch.zeros(1, 2, 32), x[1:, :3]], dim=1)  # row 1: 2 pads, 3 tokens
    batch = torch.cat([x[:1], padded])
    pad = torch.tensor([[False] * 5, [True, True, False, False, False]])
    position_ids = torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]])
    out = attn(batch, key_padding_mask=pad, is_causal=True, position_ids=position_ids)
    alone = attn(x[1:, :3], is_causal=True)
    torch.testing.assert_close(out[1, 2:], alone[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[0], attn(x[:1], is_causal=True)[0], rtol=0, atol=1e-5)
    # The positions are used: spread the real tokens apart and the row changes (a uniform
    # shift would not: rotary scores depend on differences of positions only).
    spread = attn(batch, key_padding_mask=pad, is_causal=True, position_ids=position_ids * 3)
    assert (spread[1, 2:] - alone[0]).abs().max() > 1e-3


def test_the_rotation_makes_scores_relative():
    """q at m and k at n score as q at m + s and k at n + s, for any shift s."""
    torch.manual_seed(0)
    rope = RotaryPositions(8)
    q, k = (
        torch.randn(1, 1, 1, 8, dtype=torch.float64),
        torch.randn(1, 1, 1, 8, dtype=torch.float64),
    )
    scores = [
        (rope.rotate(q, torch.tensor([m])) * rope.rotate(k, torch.tensor([n]))).sum()
        for m, n in [(3, 1), (13, 11), (403, 401)]
    ]
    torch.testing.assert_close(scores[1], scores[0], rtol=0, atol=1e-10)
    torch.testing.assert_close(scores[2], scores[0], rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rotary_dim": 5}, "rotary_dim must be an even number in [2, head_dim=8], got 5"),
        ({"rotary_dim": 10}, "rotary_dim must be an even number in [2, head_dim=8], got 10"),
        ({"rotary_dim": 8, "rope_theta": 0.5}, "rope_theta must be a number > 1, got 0.5"),
        ({"rope_theta": 1e6}, "need rotary positions; set rotary_dim too"),
        ({"rope_interleaved": True}, "need rotary positions; set rotary_dim too"),
        ({"rotary_dim": 3, "design": "mla", "kv_latent_dim": 8},
         "rotary_dim must be an even number"),
        ({"rotary_dim": 4, "design": "mla", "kv_latent_dim": 8, "rope_inv_freq": [1.0]},
         "inv_freq must be positive, (2,) or (n, 2), got [1.0]"),
        ({"rotary_dim": 4, "design": "mla", "kv_latent_dim": 8, "rope_kv_heads": 3},
         "rope_kv_heads=3 must divide num_heads=4"),
        ({"design": "mla", "kv_latent_dim": 8, "qk_head_dim": 4},
         "qk_head_dim + rotary_dim must be at least head_dim=8, got 4"),
    ],
    ids=["odd", "wider_than_head", "theta", "theta_alone", "interleaved_alone", "latent_odd",
         "latent_freqs", "latent_rope_heads", "latent_qk_narrow"],
)  # fmt: skip
def test_bad_rotary_options_are_named(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        MultiHeadAttention(32, 4, **kwargs)


def test_position_ids_need_rotary_and_rotary_needs_self_attention():
    x = torch.randn(1, 3, 32)
    with pytest.raises(ValueError, match="position_ids are for a positional part"):
        MultiHeadAttention(32, 4)(x, position_ids=torch.arange(3))
    for layer in (MultiHeadAttention(32, 4, rotary_dim=8), MultiHeadAttention(32, 4,
                  design="mla", kv_latent_dim=8, rotary_dim=4)):  # fmt: skip
        with pytest.raises(ValueError, match="positions are for self-attention"):
            layer(x, torch.randn(1, 4, 32))


# --------------------------------------------------------------------------- MLA + RoPE
def rotate_half_by_complex(x, positions, theta=10000.0):
    """RoPE written as complex multiplication: features j and j + d/2 are one number."""
    d = x.shape[-1]
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :])
    angles = positions[:, None].double() * theta ** (-torch.arange(d // 2).double() * 2 / d)
    z = z * torch.polar(torch.ones_like(angles), angles)
    return torch.cat((z.real, z.imag), dim=-1)


def decoupled_mla_reference(layer, x):
    """DeepSeek-V2's equations (section 2.1.3) from the layer's weights, causal, no cache."""
    B, L, E = x.shape
    H, latent = layer.num_heads, layer.kv_latent
    D, r, d_R = E // H, latent.latent_dim, latent.rope_dim
    positions = torch.arange(L)
    w, b = layer.in_proj.weight, layer.in_proj.bias
    q_c = (x @ w.T + b).view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
    q_r = latent.q_rope(x).view(B, L, H, d_R).transpose(1, 2)
    q_r = rotate_half_by_complex(q_r, positions)
    c = latent.down(x)  # (B, L, r)
    w_uk, w_uv = latent.up.weight.view(2, H, D, r)
    k_c = torch.einsum("blr,hdr->bhld", c, w_uk)  # (B, H, L, D)
    v = torch.einsum("blr,hdr->bhld", c, w_uv)
    k_r = rotate_half_by_complex(latent.k_rope(x), positions)[:, None]  # (B, 1, L, d_R)
    scores = (q_c @ k_c.transpose(-2, -1) + q_r @ k_r.transpose(-2, -1)) / (D + d_R) ** 0.5
    scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    heads = scores.softmax(-1) @ v  # (B, H, L, D)
    return layer.out_proj(heads.transpose(1, 2).reshape(B, L, E))


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_mla_with_decoupled_rope_follows_deepseek_v2_and_absorbs_exactly(backend):
    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 4, design="mla", kv_latent_dim=12, rotary_dim=4, backend=backend)
    layer = layer.double().eval()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x, is_causal=True)
        torch.testing.assert_close(full, decoupled_mla_reference(layer, x), rtol=0, atol=1e-12)
        for absorb, static in [(True, False), (False, False), (True, True)]:
            layer.kv_latent.absorb = absorb
            cache = layer.make_kv_cache(2, 8, static=static)
            steps = [layer(x[:, :3], is_causal=True, kv_cache=cache)]
            steps += [layer(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(3, 7)]
            torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-10)


def test_mla_caches_its_latent_and_rotary_key_beside_mha_gqa_and_mqa():
    # E = 512, H = 8 (D = 64), fp16: bytes per token and layer, counted by hand.
    def fp16_bytes(**kwargs):
        return MultiHeadAttention(512, 8, **kwargs).kv_cache_bytes_per_token(torch.float16)

    assert fp16_bytes() == 2 * 8 * 64 * 2  # MHA: K and V of 8 heads
    assert fp16_bytes(num_kv_heads=2) == 2 * 2 * 64 * 2  # GQA
    assert fp16_bytes(num_kv_heads=1) == 2 * 1 * 64 * 2  # MQA
    assert (
        fp16_bytes(design="mla", kv_latent_dim=128, rotary_dim=32) == (128 + 32) * 2
    )  # c and k_R once
    layer = MultiHeadAttention(512, 8, design="mla", kv_latent_dim=128, rotary_dim=32)
    cache = layer.make_kv_cache(1, 5)
    layer(torch.randn(1, 5, 512), is_causal=True, kv_cache=cache)
    assert cache.nbytes() == 5 * (128 + 32) * 4  # what the cache really holds (fp32)
    plain = MultiHeadAttention(512, 8, design="mla", kv_latent_dim=128)
    assert set(layer.state_dict()) - set(plain.state_dict()) == {
        "kv_latent.q_rope.weight", "kv_latent.q_rope.bias",
        "kv_latent.k_rope.weight", "kv_latent.k_rope.bias",
    }  # fmt: skip
    assert layer.head_tag == "mla8r128rope32"


# ------------------------------------------------------- rotary MHA/GQA/MQA -> MLA (issue 56)
def rotary_source(num_kv_heads, rotary_dim, interleaved):
    """A rotary layer (E = 32, H = 4, D = 8) in fp64 with every bias drawn."""
    torch.manual_seed(num_kv_heads + rotary_dim + interleaved)
    layer = MultiHeadAttention(32, 4, num_kv_heads, rotary_dim=rotary_dim,
                               rope_interleaved=interleaved, dtype=torch.float64)  # fmt: skip
    with torch.no_grad():
        layer.in_proj.bias.normal_(), layer.out_proj.bias.normal_()
    return layer.eval()


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [8, 4], ids=["full_rotary", "partial_rotary"])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_rotary_to_mla_at_full_rank_is_the_source_layer(num_kv_heads, rotary_dim, interleaved):
    # The reference is the source layer's own forward (RoPE on Q and K, then attention);
    # the copy scores through the latent plus one rotary key per K/V group.
    source, G = rotary_source(num_kv_heads, rotary_dim, interleaved), num_kv_heads
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    # V and the K features left unrotated, per group, at most E = 32
    rank = min(G * 8 + G * (8 - rotary_dim), 32)
    mla = with_kv_latent(source, rank, selection="norm", calibration=x)
    assert mla.kv_cache_bytes_per_token() == (rank + G * rotary_dim) * 4
    with torch.no_grad():
        want = source(x, is_causal=True)
        torch.testing.assert_close(mla(x, is_causal=True), want, rtol=0, atol=1e-12)
        for absorb in (True, False):  # absorbed, or K and V re-expanded each step
            mla.kv_latent.absorb, cache = absorb, mla.make_kv_cache(2, 7)
            steps = [mla(x[:, :3], is_causal=True, kv_cache=cache)]
            steps += [mla(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(3, 7)]
            torch.testing.assert_close(torch.cat(steps, 1), want, rtol=0, atol=1e-12)
    # Its head_config builds the same architecture: the state_dict loads and computes the same.
    config = {k: v for k, v in mla.head_config.items() if k != "kind"}
    rebuilt = MultiHeadAttention(32, **config, dtype=torch.float64)
    rebuilt.load_state_dict(mla.state_dict())
    torch.testing.assert_close(rebuilt.eval()(x, is_causal=True), want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="has rotary_dim, .*no MHA equivalent"):
        expand_latent(mla)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_partial_rope_keeps_the_selected_pairs_of_each_group(interleaved):
    source = rotary_source(2, 8, interleaved)  # pairs 0..3, angles 10000^(-i/4)
    freqs = 10000.0 ** (-torch.arange(4, dtype=torch.float64) / 4)
    # Pair 2 of group 0 and pair 1 of group 1 get large K weights: the largest |q_i| |k_i|.
    a, b = (
        (2 * torch.arange(4), 2 * torch.arange(4) + 1)
        if interleaved
        else (torch.arange(4), torch.arange(4) + 4)
    )
    with torch.no_grad():
        k = source.in_proj.blocks()[1]  # (G*D, E)
        for g, pair in [(0, 2), (1, 1)]:
            k[torch.stack((a[pair], b[pair])) + g * 8] *= 100
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    kept = {
        s: with_kv_latent(
            source, 8, rope_dim=2, selection=s, calibration=x if s == "norm" else None
        ).kv_latent.rope.inv_freq
        for s in ("high", "uniform", "norm")  # only "norm" reads the calibration
    }
    assert kept["high"] == ((freqs[0].item(),), (freqs[0].item(),))
    assert (
        with_kv_latent(source, 8, rope_dim=4, selection="uniform").kv_latent.rope.inv_freq
        == ((freqs[0].item(), freqs[2].item()),) * 2
    )
    assert kept["norm"] == ((freqs[2].item(),), (freqs[1].item(),))
    # The kept pair's weights: group 0's rotary key is source K rows a[2], b[2].
    mla = with_kv_latent(source, 8, rope_dim=2, selection="norm", calibration=x)
    k = source.in_proj.blocks()[1].detach()
    torch.testing.assert_close(
        mla.kv_latent.k_rope.weight[:2], k[torch.stack((a[2], b[2]))], rtol=0, atol=0
    )


@pytest.mark.parametrize(
    ("rotary_dim", "kwargs", "message"),
    [
        (8, {"rope_dim": 3}, "rope_dim of 'gqa4kv2-rope' must be an even number in [2, 8], "),
        (4, {"rope_dim": 6}, "must be an even number in [2, 4], whole pairs, got 6"),
        (None, {"rope_dim": 2}, "rope_dim of 'mha4' must be None: it has no rotary, got 2"),
        (8, {"selection": "low"}, "selection must be 'high', 'uniform' or 'norm', got 'low'"),
        (8, {"selection": "norm"}, "selection='norm' needs calibration, the layer's inputs"),
        (8, {"kv_latent_dim": 17}, "a K/V latent of 17 is more than the rank 16 of the K/V "
         "stack of 'gqa4kv2-rope' (E = 32, G(2D - rope_dim) = 16)"),  # the rotary keys apart
    ],
    ids=["odd", "wider", "no_rotary", "selection", "no_calibration", "rank"],
)  # fmt: skip
def test_bad_rotary_conversions_are_named(rotary_dim, kwargs, message):
    layer = MultiHeadAttention(32, 4) if rotary_dim is None else rotary_source(2, rotary_dim, False)
    with pytest.raises(ValueError, match=re.escape(message)):
        with_kv_latent(layer, **({"kv_latent_dim": 8} | kwargs))
