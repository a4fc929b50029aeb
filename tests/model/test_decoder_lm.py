"""DecoderLM: the four designs of the long-context comparison from one family, differing in
attention alone; the short convolution against a hand sum; cached decoding equals the full
pass; the cache holds the bytes counted by hand; bad values refused by name."""

from __future__ import annotations

import pytest
import torch

from multihead.model.lm import DecoderLM, ShortConv

E, H, LAYERS, V = 64, 8, 2, 97
DESIGNS = {  # attention, and the numbers each block caches per token, counted by hand
    "mha": ({"num_heads": H}, 2 * H * (E // H)),
    "gqa": ({"num_heads": H, "num_kv_heads": H // 4}, 2 * (H // 4) * (E // H)),
    "mqa": ({"num_heads": H, "num_kv_heads": 1}, 2 * (E // H)),
    # MLA at 1/8 of MHA's cache: a latent of 12 and a rotary key of 4 (= 2E/8).
    "mla": ({"num_heads": H, "design": "mla", "rotary_dim": 4,
             "design_options": {"kv_latent_dim": 12}}, 12 + 4),
}  # fmt: skip


def build(design: str, **kwargs) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(
        vocab_size=V, d_model=E, ffn_dim=128, num_layers=LAYERS, max_positions=64,
        attention=DESIGNS[design][0], **kwargs,
    ).eval()  # fmt: skip


def test_the_short_convolution_mixes_each_feature_over_its_last_k_inputs_only():
    torch.manual_seed(0)
    conv, x = ShortConv(6, 3), torch.randn(2, 9, 6)
    w, b = conv.conv.weight[:, 0], conv.conv.bias  # (E, K), (E,)
    padded = torch.cat([torch.zeros(2, 2, 6), x], dim=1)  # zeros before the start
    expected = torch.stack(
        [sum(w[:, j] * padded[:, t + j] for j in range(3)) + b for t in range(9)], dim=1
    )
    out, past = conv(x)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(past, x[:, -2:])  # what the next position needs, no more


@pytest.mark.parametrize("design", DESIGNS)
def test_cached_decoding_equals_the_full_pass_and_the_cache_is_the_counted_size(design):
    lm = build(design)
    ids = torch.randint(1, V, (3, 40))
    with torch.no_grad():
        full = lm(ids)
        caches = lm.make_cache(3, 40)
        steps = [lm(ids[:, :17], caches)] + [lm(ids[:, t : t + 1], caches) for t in range(17, 40)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=1e-5)
    numbers = DESIGNS[design][1]
    assert lm.kv_cache_bytes_per_token() == LAYERS * numbers * 4  # fp32
    if design in ("mqa", "mla"):  # both at 1/8 of MHA's
        assert lm.kv_cache_bytes_per_token() * 8 == LAYERS * DESIGNS["mha"][1] * 4


def test_the_designs_differ_in_their_attention_parameters_alone():
    counts = {}
    for design in DESIGNS:
        lm = build(design)
        rest = {n: p.shape for n, p in lm.named_parameters() if ".self_attn." not in n}
        counts[design] = rest
    assert all(c == counts["mha"] for c in counts.values())
    # MHA's attention: Q, K, V and O, each E x E with a bias.
    assert build("mha").attention_parameters() == LAYERS * 4 * (E * E + E)


def test_the_positions_come_from_the_cache_and_bad_values_are_refused():
    lm = build("gqa")
    with pytest.raises(ValueError, match="input_ids must be token ids"):
        lm(torch.rand(2, 5))
    with pytest.raises(ValueError, match=r"input_ids must be \(B, T\)"):
        lm(torch.ones(2, 5, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="num_layers must be a positive integer, got 0"):
        DecoderLM(vocab_size=V, d_model=E, ffn_dim=8, num_layers=0, max_positions=8,
                  attention={"num_heads": 2})  # fmt: skip
    with pytest.raises(ValueError, match="conv_kernel must be a positive integer, got 0"):
        DecoderLM(vocab_size=V, d_model=E, ffn_dim=8, num_layers=1, max_positions=8,
                  conv_kernel=0, attention={"num_heads": 2})  # fmt: skip
