"""Multi-head latent attention against torch's own MHA built from its weight products."""

import copy
import re

import pytest
import torch
from torch import nn

from multihead import MultiHeadAttention
from multihead.attention import with_kv_heads, with_kv_latent
from multihead.attention.convert import expand_latent

E, H, R = 32, 4, 12
D = E // H
B, L, S = 2, 5, 7


def mla(seed: int = 0, **options) -> MultiHeadAttention:
    """An MLA layer with random (non-zero) biases, in eval mode."""
    torch.manual_seed(seed)
    layer = MultiHeadAttention(E, H, design="mla", kv_latent_dim=R, **options)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    return layer.eval()


def inputs():
    g = torch.Generator().manual_seed(1)
    x, memory = torch.randn(B, L, E, generator=g), torch.randn(B, S, E, generator=g)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, -3:] = True
    return x, memory, pad


def torch_reference(layer: MultiHeadAttention) -> nn.MultiheadAttention:
    """torch.nn.MultiheadAttention whose K/V weights are the products W_UK W_DKV, W_UV W_DKV."""
    latent = layer.design
    ref = nn.MultiheadAttention(E, H, batch_first=True)
    w_uk, w_uv = latent.up.weight[:E], latent.up.weight[E:]  # (E, r) each
    with torch.no_grad():
        ref.in_proj_weight.copy_(
            torch.cat([layer.in_proj.weight, w_uk @ latent.down.weight, w_uv @ latent.down.weight])
        )
        ref.in_proj_bias.copy_(
            torch.cat([layer.in_proj.bias, w_uk @ latent.down.bias, w_uv @ latent.down.bias])
        )
        ref.out_proj.load_state_dict(layer.out_proj.state_dict())
    return ref.eval()


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_mla_equals_torch_mha_of_the_weight_products(backend):
    layer = mla(backend=backend)
    ref = torch_reference(layer)
    x, memory, pad = inputs()
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    with torch.no_grad():
        expected = ref(x, x, x, attn_mask=causal, need_weights=False)[0]
        torch.testing.assert_close(layer(x, is_causal=True), expected, atol=1e-5, rtol=1e-5)
        expected, weights = ref(memory[:, :L], memory, memory, key_padding_mask=pad)
        out, ours = layer(memory[:, :L], memory, key_padding_mask=pad, need_weights=True)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.mean(1), weights, atol=1e-6, rtol=1e-5)


def test_absorbed_weights_follow_the_parameters():
    layer = mla()
    x, _, _ = inputs()
    with torch.no_grad():
        layer(x[:, :1], is_causal=True, kv_cache=layer.make_kv_cache(B, L))  # folds
        layer.design.up.weight.mul_(2.0)  # an optimiser step would change it in place too
        cache = layer.make_kv_cache(B, L)
        steps = [layer(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(L)]
        torch.testing.assert_close(torch.cat(steps, 1), layer(x, is_causal=True), atol=1e-5, rtol=0)


def test_the_cache_holds_the_latent_alone():
    layer = mla()
    x, _, _ = inputs()
    cache = layer.make_kv_cache(B, 8)
    with torch.no_grad():
        layer(x, is_causal=True, kv_cache=cache)
    assert cache.k.shape == (B, 1, 8, R) and cache.v is cache.k
    assert cache.nbytes() == B * L * R * 4
    assert layer.kv_cache_bytes_per_token() == R * 4
    assert MultiHeadAttention(E, H).kv_cache_bytes_per_token() == 2 * E * 4  # MHA: K and V
    with torch.no_grad():
        cache.select(torch.tensor([1, 1, 0]))  # beams reorder the latent only
    assert cache.k.shape == (3, 1, 8, R) and cache.v is cache.k


def test_names_and_options():
    layer = mla()
    assert layer.head_tag == "mla4r12"
    assert layer.head_config == {
        "kind": "mla",
        "num_heads": H,
        "num_kv_heads": H,
        "design": "mla",
        "kv_latent_dim": R,
    }
    assert layer.in_proj.weight.shape == (E, E)  # Q alone: K and V come from the latent
    normed = MultiHeadAttention(E, H, design="mla", kv_latent_dim=R, kv_latent_norm=True)
    assert normed.head_tag == "mla4r12n" and isinstance(normed.design.norm, nn.RMSNorm)


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"design": "mla", "kv_latent_dim": 0}, r"kv_latent_dim must be >= 1, got 0"),
        (
            {"design": "mla", "kv_latent_dim": 8, "num_kv_heads": 2},
            r"'mla' has one K/V head per query head; got num_kv_heads=2",
        ),
        ({"design": "mla", "top_k_heads": 2}, r"'mla' takes no option top_k_heads"),
        ({"design": "group_mlp", "kv_latent_dim": 8}, r"'group_mlp' takes no option kv_latent_dim"),
    ],
)
def test_invalid_latent_options_raise(options, pattern):
    with pytest.raises(ValueError, match=pattern):
        MultiHeadAttention(E, H, **options)


@pytest.mark.parametrize(
    ("num_kv_heads", "rank"), [(None, E), (2, 4 * D), (1, 2 * D)]
)  # min(2GD, E)
def test_conversion_is_exact_at_the_stacked_rank(num_kv_heads, rank):
    torch.manual_seed(0)
    layer = MultiHeadAttention(E, H, num_kv_heads).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    x, memory, pad = inputs()
    exact = with_kv_latent(layer, rank)
    low = with_kv_latent(layer, rank // 2)
    with torch.no_grad():
        expected = layer(x, memory, key_padding_mask=pad)
        torch.testing.assert_close(
            exact(x, memory, key_padding_mask=pad), expected, atol=2e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            exact(x, is_causal=True), layer(x, is_causal=True), atol=2e-5, rtol=1e-5
        )
        assert (low(x, memory, key_padding_mask=pad) - expected).abs().max() > 1e-2


def test_export_equivalent_and_refusals():
    layer = mla()
    x, memory, pad = inputs()
    with torch.no_grad():
        torch.testing.assert_close(
            expand_latent(layer)(x, memory, key_padding_mask=pad),
            layer(x, memory, key_padding_mask=pad),
            atol=1e-5,
            rtol=1e-5,
        )
    with pytest.raises(ValueError, match="has kv_latent_norm, which no MHA layer computes"):
        expand_latent(MultiHeadAttention(E, H, design="mla", kv_latent_dim=R, kv_latent_norm=True))
    with pytest.raises(ValueError, match="with_kv_heads converts a plain MHA/GQA/MQA layer or a"):
        with_kv_heads(layer, 1)
    with pytest.raises(ValueError, match=r"plain MHA/GQA/MQA layer.*mla4r12"):
        with_kv_latent(layer, 4)


def test_absorbed_decoding_after_a_fused_adam_step_uses_the_new_weights():
    """Fused Adam writes the parameters in place without bumping their version counter: a
    search after the step must decode with the new weights (an earlier version folded them
    into the projections once per search)."""
    layer = mla()
    x, _, _ = inputs()
    with torch.no_grad():
        layer(x[:, :1], is_causal=True, kv_cache=layer.make_kv_cache(B, L))  # a search
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.1, fused=True)
    layer.train()
    layer(x, is_causal=True).square().sum().backward()
    optimizer.step()
    layer.eval()
    with torch.no_grad():
        cache = layer.make_kv_cache(B, L)
        steps = [layer(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(L)]
        expected = torch_reference(layer)(x, x, x, attn_mask=torch.ones(L, L).triu(1).bool())[0]
    torch.testing.assert_close(torch.cat(steps, 1), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("num_kv_heads", "r", "message"),
    [(None, 40, "a K/V latent of 40 is more than the rank 32 of the K/V stack of 'mha4' (E = "
      "32, G(2D - rope_dim) = 64): 8 of its numbers would always be zero"),
     (2, 33, "a K/V latent of 33 is more than the rank 32 of the K/V stack of 'gqa4kv2' (E = "
      "32, G(2D - rope_dim) = 32): 1 of its numbers")],
    ids=["wider_than_E", "more_cache_than_the_layer"],
)  # fmt: skip
def test_a_latent_above_the_rank_of_the_kv_stack_is_refused(num_kv_heads, r, message):
    """MHA with r = 40 > E was accepted, its last 8 numbers always zero; GQA 4/2 with r = 33
    caches more than the layer's 2 * 2 heads * 8 (refused before, in other words)."""
    layer = MultiHeadAttention(E, H, num_kv_heads=num_kv_heads)
    with pytest.raises(ValueError, match=re.escape(message)):
        with_kv_latent(layer, r)
    assert with_kv_latent(layer, 32).kv_latent.latent_dim == 32  # the rank itself: allowed


@pytest.mark.parametrize(
    "options",
    [{"rotary_dim": 4}, {"qk_head_dim": 8}, {"softmax_scale": 0.5}, {"v_head_dim": 4},
     {"q_latent_dim": 8}],
    ids=["rotary_key", "qk_width", "scale", "v_width", "low_rank_query"],
)  # fmt: skip
def test_expand_latent_refuses_what_no_mha_layer_computes(options):
    """25fe9c2 returned a plain MHA layer: the rotary key gone, the scale wrong (0.036 off)."""
    layer = MultiHeadAttention(24, 4, design="mla", kv_latent_dim=8, **options)
    with pytest.raises(ValueError, match=f"has {next(iter(options))}, which no MHA layer"):
        expand_latent(layer)


@pytest.mark.parametrize("rotary_dim", [None, 4])
def test_a_cached_eval_mode_call_gives_the_full_pass_gradients(rotary_dim):
    """25fe9c2 folded the absorbed weights under no_grad: no gradient, and backward passed."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(24, 4, design="mla", kv_latent_dim=8, rotary_dim=rotary_dim).eval()
    x = torch.randn(2, 5, 24)

    def grads(out):
        layer.zero_grad()
        (out * torch.linspace(-1, 1, 24)).sum().backward()
        return {n: p.grad for n, p in layer.named_parameters()}

    full = grads(layer(x, is_causal=True))
    # One call into an empty cache: the absorbed path (the cache's in-place writes keep
    # autograd from reaching back through earlier steps, whatever the design).
    cached = grads(layer(x, is_causal=True, kv_cache=layer.make_kv_cache(2, 5)))
    assert set(cached) == set(full)
    for name, grad in full.items():
        assert cached[name] is not None, name
        torch.testing.assert_close(cached[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_deepseek_widths_and_low_rank_query_decode_absorbed_as_the_full_pass():
    """DeepSeek-V3's shape: V heads wider than E / H (10 > 6), Q/K heads of their own width
    and a normalised low-rank query, which the absorbed query projection reads."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(
        24, 4, design="mla", kv_latent_dim=8, kv_latent_norm=True, rotary_dim=4, qk_head_dim=6,
        v_head_dim=10, q_latent_dim=5, rope_interleaved=True,
    ).eval()  # fmt: skip
    assert layer.in_proj.weight.shape == (4 * 6, 5) and layer.out_proj.weight.shape == (24, 40)
    assert layer.design.up.weight.shape == (4 * (6 + 10), 8)
    # Q/K heads D = 6 wide (not spelled), V heads 10, a digest of the interleaved pairs
    assert re.fullmatch(r"mla4r8nq5rope4v10-[0-9a-f]{6}", layer.head_tag), layer.head_tag
    assert {"v_head_dim": 10, "q_latent_dim": 5}.items() <= layer.head_config.items()
    x = torch.randn(2, 5, 24)
    cache = layer.make_kv_cache(2, 5)
    with torch.no_grad():
        steps = [layer(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(5)]
        full = layer(x, is_causal=True)
    assert cache.k.shape == (2, 1, 5, 8 + 4)  # the latent and the rotary key alone
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)


def test_a_v_head_narrower_than_the_scores_is_padded_but_not_wider():
    with pytest.raises(ValueError, match=r"rotary_dim must be at least v_head_dim=12, got 6"):
        MultiHeadAttention(
            24, 4, design="mla", kv_latent_dim=8, qk_head_dim=6, rotary_dim=4, v_head_dim=12
        )
    with pytest.raises(ValueError, match="q_latent_dim must be >= 1, got 0"):
        MultiHeadAttention(24, 4, design="mla", kv_latent_dim=8, q_latent_dim=0)


def test_load_factors_sets_the_latents_weights_and_linear_kv_gives_them_back():
    """load_factors writes W_DKV, W_UK, W_UV and the rotary key (a bias not given: zero),
    refusing a misfit by name before it changes anything; linear_kv is each head's K and V
    and the rotary keys of the weights alone."""
    Dq, d_R, G_R = 6, 4, 2
    torch.manual_seed(0)
    layer = MultiHeadAttention(E, H, design="mla", kv_latent_dim=R, qk_head_dim=Dq,
                               rotary_dim=d_R, rope_kv_heads=G_R, dtype=torch.float64)  # fmt: skip
    latent = layer.design
    g = torch.Generator().manual_seed(1)
    down, up_k, up_v = (torch.randn(*s, generator=g) for s in ((R, E), (H * Dq, R), (H * D, R)))
    q_rope, k_rope = torch.randn(H * d_R, E, generator=g), torch.randn(G_R * d_R, E, generator=g)
    before = copy.deepcopy(latent.state_dict())
    with pytest.raises(ValueError, match=r"^up_k of head design 'mla' \(r12rope4x2qk6\) must be "
                                         r"\(24, 12\), got \(32, 12\)$"):  # fmt: skip
        latent.load_factors(down, up_v, up_v, q_rope=q_rope, k_rope=k_rope)
    with pytest.raises(ValueError, match=r"rotary key \(rotary_dim=4\): .* needs q_rope and k_r"):
        latent.load_factors(down, up_k, up_v)
    assert all(torch.equal(v, before[k]) for k, v in latent.state_dict().items())
    latent.load_factors(down, up_k, up_v, q_rope=q_rope, k_rope=k_rope,
                        k_rope_bias=torch.ones(G_R * d_R))  # fmt: skip
    state = latent.state_dict()
    assert torch.equal(state["up.weight"], torch.cat((up_k, up_v)).double())
    assert torch.equal(state["k_rope.bias"], torch.ones(G_R * d_R, dtype=torch.float64))
    assert not state["down.bias"].any() and not state["q_rope.bias"].any()
    x = torch.randn(B, S, E, generator=g, dtype=torch.float64)
    k, v, keys = latent.linear_kv(x)
    c = x @ down.double().T  # (B, S, r)
    torch.testing.assert_close(k, (c @ up_k.double().T).view(B, S, H, Dq).transpose(1, 2))
    torch.testing.assert_close(v, (c @ up_v.double().T).view(B, S, H, D).transpose(1, 2))
    torch.testing.assert_close(keys, (x @ k_rope.double().T).view(B, S, G_R, d_R).transpose(1, 2))
    plain = MultiHeadAttention(E, H, design="mla", kv_latent_dim=R).design
    with pytest.raises(ValueError, match=r"^head design 'mla' \(r12\) has no k_rope$"):
        plain.load_factors(down, up_v, up_v, k_rope=k_rope)
    assert plain.linear_kv(x.float())[2] is None
