"""Equal terms counted from the model, against counts written out by hand: parameters (all
and attention), multiply-adds per token at a context, each head's score width and its rotary
features, and KV-cache bytes per token, for MHA, GQA and MLA on a small decoder LM."""

from __future__ import annotations

import pytest

from multihead.analysis.describe import describe
from multihead.model.lm import DecoderLM

# E = 32, H = 4 heads of D = 8, FFN 64, 2 blocks, vocabulary 50 (tied output, no bias),
# causal convolution of kernel 3, context T = 16: a query sees (16 + 1) / 2 = 8.5 keys on
# average over a causal pass.
SIZES = dict(vocab_size=50, d_model=32, ffn_dim=64, num_layers=2, max_positions=16)
# Per block, the same in every design (weights + biases):
#   conv_norm 64, conv 32*3 + 32 = 128, self_attn_norm 64, ffn_norm 64,
#   linear1 32*64 + 64 = 2112, linear2 64*32 + 32 = 2080        -> 4512
# Once: embedding 50*32 = 1600 (the output shares it), final norm 64 -> 1664.
# Multiply-adds per token outside attention, per block: conv 96, FFN 32*64 + 64*32 = 4096
# -> 4192; once: the output projection 32*50 = 1600.
HAND = {
    # MHA: in_proj 32*96 + 96 = 3168, out_proj 32*32 + 32 = 1056 -> 4224 per layer.
    # MACs per layer: in_proj 3072 + out 1024; scores 4 heads * (8 + 8) * 8.5 = 544.
    # KV cache: K and V, 4 heads of 8 fp32 = 256 bytes per layer.
    "mha": dict(
        attention={"num_heads": 4},
        params=1664 + 2 * (4512 + 4224),
        attention_params=2 * 4224,
        macs=1600 + 2 * (4192 + 3072 + 1024 + 544),
        score=(8, 8),
        kv=2 * 256,
    ),
    # GQA, 2 K/V heads: in_proj 32*(32 + 2*16) + 64 = 2112, out_proj 1056 -> 3168.
    # MACs: in_proj 2048 + out 1024; scores as MHA's, 544. KV: 2 * 2 * 8 * 4 = 128 bytes.
    "gqa": dict(
        attention={"num_heads": 4, "num_kv_heads": 2},
        params=1664 + 2 * (4512 + 3168),
        attention_params=2 * 3168,
        macs=1600 + 2 * (4192 + 2048 + 1024 + 544),
        score=(8, 8),
        kv=2 * 128,
    ),
    # MLA, latent r = 12, decoupled rotary key d_R = 4: Q 32*32 + 32 = 1056, rotary query
    # 32*16 + 16 = 528, down 32*12 + 12 = 396, up 12*(4*(8 + 8)) = 768 (no bias), rotary
    # key 32*4 + 4 = 132, out_proj 1056 -> 3936. MACs: 1024 + 512 + 384 + 768 + 128 + 1024
    # = 3840; each head's score is 8 latent + 4 rotary = 12 features, its value 8:
    # 4 * (12 + 8) * 8.5 = 680. KV: the latent and the rotary key, (12 + 4) * 4 = 64 bytes.
    "mla": dict(
        attention={
            "num_heads": 4,
            "design": "mla",
            "rotary_dim": 4,
            "design_options": {"kv_latent_dim": 12},
        },
        params=1664 + 2 * (4512 + 3936),
        attention_params=2 * 3936,
        macs=1600 + 2 * (4192 + 3840 + 680),
        score=(12, 4),
        kv=2 * 64,
    ),
}


@pytest.mark.parametrize("design", sorted(HAND))
def test_equal_terms_are_the_hand_counts(design: str) -> None:
    hand = HAND[design]
    model = DecoderLM(**SIZES, attention=hand["attention"])
    found = describe(model, context=16)
    assert found.params == hand["params"]
    assert found.attention_params == hand["attention_params"]
    assert found.macs_per_token == hand["macs"]
    (scores,) = found.scores
    assert (scores.width, scores.positional) == hand["score"]
    assert found.kv_bytes_per_token == hand["kv"]


def test_a_context_that_is_not_a_positive_int_is_refused() -> None:
    model = DecoderLM(**SIZES, attention={"num_heads": 4})
    with pytest.raises(ValueError, match=r"^context=0: expected a positive number of tokens"):
        describe(model, context=0)


def test_a_run_is_described_from_its_saved_config() -> None:
    """A run's model built from its saved config (the LM at its data's context); a
    vocabulary the config does not state (a tokenizer's own size) is solved from the
    parameters the run recorded: 10 more rows of the 32-wide tied embedding than the
    config's 50 give 19,136 + 320 = 19,456. A config today's code cannot build is described
    by its summary, saying why."""
    from multihead.analysis.describe import describe_run
    from multihead.analysis.runs import RunResult

    config = {
        "data": {"vocab_size": 50, "context": 16},
        "model": {"_target_": "multihead.model.lm.DecoderLM", "d_model": 32, "ffn_dim": 64,
                  "num_layers": 2, "max_positions": "${data.context}"},
        "attention": {"num_heads": 4},
    }  # fmt: skip
    run = RunResult("mha", {"params/total": HAND["mha"]["params"]}, config=config)
    assert describe_run(run).macs_per_token == HAND["mha"]["macs"]
    run.summary["params/total"] = 19_456
    found = describe_run(run)
    assert found.params == 19_456 and found.macs_per_token == HAND["mha"]["macs"] + 10 * 32
    assert found.notes[0].startswith("vocabulary 60 (the tokenizer's, solved from the 19,456")
    config["attention"]["num_heads"] = 3
    run = RunResult("old", {"params/total": 5, "kv_cache/bytes_per_token": 7}, config=config)
    found = describe_run(run)
    assert (found.params, found.kv_bytes_per_token) == (5, 7)
    assert found.notes[0].startswith("not built from its config (embed_dim (32) must be divis")
