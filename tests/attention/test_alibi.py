"""ALiBi's slopes and bias against the paper's code and HF's BLOOM (``build_alibi_tensor``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from multihead.attention.alibi import ALiBi, alibi_slopes


def _paper_slopes(n: int) -> list[float]:
    # The paper's code (ofirpress/attention_with_linear_biases, fairseq transformer.py), for
    # a power of two n: a geometric sequence that starts at, and has the ratio, 2^(-8/n).
    start = 2 ** (-(2 ** -(math.log2(n) - 3)))
    return [start * start**i for i in range(n)]


@pytest.mark.parametrize("num_heads", [1, 2, 4, 8, 16, 32, 64])
def test_slopes_for_a_power_of_two_are_the_papers(num_heads: int) -> None:
    want = torch.tensor(_paper_slopes(num_heads), dtype=torch.float64)
    torch.testing.assert_close(alibi_slopes(num_heads).double(), want, rtol=1e-6, atol=0)


def _hf_alibi(mask: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF BLOOM's bias, ``(B, H, S)``: slope times each key's position in its row."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    return build_alibi_tensor(mask, num_heads, torch.float32).view(mask.shape[0], num_heads, -1)


@pytest.mark.parametrize("num_heads", [3, 5, 6, 7, 12, 20, 24, 40, 112])
def test_slopes_for_other_head_counts_are_blooms(num_heads: int) -> None:
    pytest.importorskip("transformers", reason="transformers is the [hf] extra")
    want = _hf_alibi(torch.ones(1, 2), num_heads)[0, :, 1]  # slope * position 1
    torch.testing.assert_close(alibi_slopes(num_heads), want, rtol=1e-6, atol=0)


def test_the_bias_is_blooms_up_to_a_constant_per_row_with_left_padding() -> None:
    # BLOOM adds m*j with j counted from the first token of each row (the mask's cumsum);
    # the part adds -m*|i - j| with i, j the indices in the padded row. On every key a causal
    # query sees, the two differ by one constant per row, which softmax cancels.
    pytest.importorskip("transformers", reason="transformers is the [hf] extra")
    mask = torch.ones(2, 7)
    mask[1, :3] = 0  # 3 left-padding tokens
    H = 6
    theirs = _hf_alibi(mask, H)[:, :, None, :]  # (B, H, 1, S)
    ours = ALiBi(H).score_bias(torch.arange(7), torch.arange(7))  # (1, H, L, S)
    sees = torch.ones(7, 7).tril().bool() & mask.bool()[:, None, None, :]  # (B, 1, L, S)
    difference = (ours - theirs).masked_fill(~sees, float("nan"))  # (B, H, L, S)
    row_constant = difference.nanmean(dim=-1, keepdim=True)
    torch.testing.assert_close(
        difference[sees.expand_as(difference)],
        row_constant.expand_as(difference)[sees.expand_as(difference)],
        rtol=0,
        atol=1e-5,
    )


def test_the_bias_is_minus_slope_times_distance_per_head_and_row() -> None:
    q, k = torch.tensor([[4, 5], [0, 1]]), torch.tensor([[0, 3, 5], [0, 1, 2]])  # (B, L), (B, S)
    bias = ALiBi(2).score_bias(q, k)  # slopes 2^-4, 2^-8
    assert bias.shape == (2, 2, 2, 3)
    assert bias[0, 0].tolist() == [[-4 / 16, -1 / 16, -1 / 16], [-5 / 16, -2 / 16, 0.0]]
    assert bias[1, 1].tolist() == [[0.0, -1 / 256, -2 / 256], [-1 / 256, 0.0, -1 / 256]]


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, None])
def test_a_head_count_that_is_not_a_positive_int_is_refused(bad) -> None:
    with pytest.raises((TypeError, ValueError), match=f"^num_heads must be .*got {bad!r}$"):
        ALiBi(bad)


# --------------------------------------------------------------------------- in the layer
def alibi_layer(E: int = 32, H: int = 8, G: int | None = 2, **kwargs):
    from multihead import MultiHeadAttention

    torch.manual_seed(0)
    return MultiHeadAttention(E, H, G, positions=ALiBi(H), **kwargs).eval()


def _written_out(layer, x, pad, causal: bool) -> torch.Tensor:
    """softmax(Q K^T / sqrt(D) - m_h |i - j|, masked) V W^O + b, from the layer's weights."""
    B, L, E = x.shape
    H, G = layer.num_heads, layer.num_kv_heads
    D = E // H
    q, k, v = F.linear(x, layer.in_proj.weight, layer.in_proj.bias).split([E, G * D, G * D], -1)
    q = q.view(B, L, H, D).transpose(1, 2)
    k, v = (t.view(B, L, G, D).transpose(1, 2).repeat_interleave(H // G, 1) for t in (k, v))
    i = torch.arange(L)
    slopes = torch.tensor(_paper_slopes(H))  # H a power of two
    scores = q @ k.transpose(-2, -1) / D**0.5 - slopes[:, None, None] * (i[:, None] - i).abs()
    hidden = pad[:, None, None, :] | ((i[None, :] > i[:, None]) if causal else False)
    out = scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v  # (B, H, L, D)
    return out.transpose(1, 2).reshape(B, L, E) @ layer.out_proj.weight.T + layer.out_proj.bias


@pytest.mark.parametrize("backend", ["math", "sdpa", "flex"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_every_backend_that_takes_a_score_bias_is_the_formula(backend: str, causal: bool) -> None:
    layer = alibi_layer(backend=backend)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(3))
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True  # right padding
    with torch.no_grad():  # flex has no backward on the CPU
        got = layer(x, key_padding_mask=pad, is_causal=causal)
    want = _written_out(layer, x, pad, causal)
    torch.testing.assert_close(got[~pad], want[~pad], rtol=0, atol=1e-5)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_cached_decoding_equals_the_full_pass(static: bool) -> None:
    layer = alibi_layer()
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(4))
    full = layer(x, is_causal=True)
    cache = layer.make_kv_cache(2, 12, static=static)
    steps = [layer(x[:, :4], is_causal=True, kv_cache=cache)]  # a prompt of 4, then 1 by 1
    steps += [layer(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-6)


# flash_attn too, by its registry entry; here its missing package is refused before that.
@pytest.mark.parametrize("backend", ["flash", "cudnn"])
def test_a_backend_that_takes_no_score_bias_refuses_it_by_name(backend: str) -> None:
    with pytest.raises(ValueError, match=f"backend '{backend}' takes no score bias \\(ALiBi\\)"):
        alibi_layer(backend=backend)


def test_alibi_is_for_self_attention() -> None:
    with pytest.raises(ValueError, match="positions are for self-attention; got a key_value"):
        alibi_layer()(torch.randn(1, 3, 32), torch.randn(1, 4, 32))


def _moh_written_out(layer, x, pad, causal: bool) -> torch.Tensor:
    """Mixture-of-Head attention with ALiBi, from the layer's weights: every head's
    ``softmax(Q K^T / sqrt(D) - m_h |i - j|, masked) V`` densely, then each token's output
    ``sum_h g_h head_h W^O_h + b``, ``g`` 1 for a shared head, the softmax of the token's top-k
    router logits for a routed head it selected, 0 otherwise."""
    B, L, E = x.shape
    H, G, D = layer.num_heads, layer.num_kv_heads, E // layer.num_heads
    q, k, v = F.linear(x, layer.in_proj.weight, layer.in_proj.bias).split([E, G * D, G * D], -1)
    q = q.view(B, L, H, D).transpose(1, 2)
    k, v = (t.view(B, L, G, D).transpose(1, 2).repeat_interleave(H // G, 1) for t in (k, v))
    i = torch.arange(L)
    slopes = torch.tensor(_paper_slopes(H))
    scores = q @ k.transpose(-2, -1) / D**0.5 - slopes[:, None, None] * (i[:, None] - i).abs()
    hidden = pad[:, None, None, :] | ((i[None, :] > i[:, None]) if causal else False)
    heads = scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v  # (B, H, L, D)
    router, Hs = layer.head_gate, layer.head_gate.num_shared
    top, chosen = (x @ router.weight.T).topk(router.top_k, dim=-1)  # (B, L, k)
    routed = torch.zeros(B, L, H - Hs).scatter(-1, chosen, top.softmax(-1))
    gates = torch.cat((torch.ones(B, L, Hs), routed), dim=-1)  # (B, L, H)
    w_o = layer.out_proj.weight.view(E, H, D)
    return torch.einsum("bhld,blh,ehd->ble", heads, gates, w_o) + layer.out_proj.bias


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_sparse_heads_take_alibi_as_the_formula(backend: str, causal: bool) -> None:
    """Sparse heads run on the layer's steps: its mask carries the score bias (they refused
    ALiBi when they wrote their own forward)."""
    layer = alibi_layer(backend=backend, design="moh", top_k_heads=2, num_shared_heads=2)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(3))
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    with torch.no_grad():
        got = layer(x, key_padding_mask=pad, is_causal=causal)
        want = _moh_written_out(layer, x, pad, causal)
        torch.testing.assert_close(got[~pad], want[~pad], rtol=0, atol=1e-5)
        if causal:  # cached decoding, each key's position stored in the cache
            for static in (False, True):
                cache = layer.make_kv_cache(2, 9, static=static)
                steps = [layer(x[:, :3], is_causal=True, kv_cache=cache)]  # a prompt, then 1 by 1
                steps += [layer(x[:, [t]], is_causal=True, kv_cache=cache) for t in range(3, 7)]
                full = layer(x, is_causal=True)
                torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_mla_takes_alibi_as_its_expanded_mha_layer_does(backend: str) -> None:
    """ALiBi is a bias on the scores, which MLA's latent K/V leave as they are: an MLA layer
    with it equals its MHA equivalent (expand_latent, which keeps the positions) with it,
    in a full pass and in absorbed cached decoding."""
    from multihead.attention import expand_latent

    layer = alibi_layer(G=None, backend=backend, design="mla", kv_latent_dim=16)
    mha = expand_latent(layer)
    assert mha.design is None and mha.positions is layer.positions
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(5))
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    with torch.no_grad():
        for causal in (False, True):
            got = layer(x, key_padding_mask=pad, is_causal=causal)
            torch.testing.assert_close(got, mha(x, key_padding_mask=pad, is_causal=causal))
            want = _written_out(mha, x, pad, causal)
            torch.testing.assert_close(got[~pad], want[~pad], rtol=0, atol=1e-5)
        full = mha(x, is_causal=True)
        for static in (False, True):
            cache = layer.make_kv_cache(2, 9, static=static)
            steps = [layer(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(7)]
            torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5)


def test_conversions_keep_alibi_or_refuse_it() -> None:
    from multihead.attention import prune_heads, with_kv_heads

    layer = alibi_layer(G=None)
    assert with_kv_heads(layer, 2).positions is layer.positions  # the same H heads and slopes
    with pytest.raises(
        ValueError, match=r"prune_heads cannot keep a score bias, one per head of 8"
    ):
        prune_heads(layer, [0])
