import math

import pytest
import torch

from multihead.attention import MultiHeadAttention, prune_heads
from multihead.attention.alibi import ALiBi
from multihead.model import Transformer

from helpers.models import BOS, PAD, VOCAB, random_src, tiny_model

VARIANTS = {"mha": None, "gqa": 2, "mqa": 1}


def test_forward_shapes_and_pad_mask():
    model = tiny_model()
    src = random_src(3, 7)
    tgt = torch.randint(3, VOCAB, (3, 5))
    assert model(src, tgt).shape == (3, 5, VOCAB)
    memory, pad = model.encode(src)
    assert memory.shape == (3, 7, 32)
    assert torch.equal(pad, src.eq(PAD))


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("positional", ["sinusoidal", "learned", "rope", "alibi"])
def test_post_and_pre_ln_train_step(norm_first, positional):
    model = tiny_model(norm_first=norm_first, positional=positional, dropout=0.1).train()
    assert isinstance(model.encoder_norm, torch.nn.LayerNorm) == norm_first
    logits = model(random_src(2, 6), torch.randint(3, VOCAB, (2, 4)))
    logits.logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_gelu_and_bad_activation():
    assert tiny_model(activation="gelu")(random_src(1, 3), torch.tensor([[BOS]])).isfinite().all()
    with pytest.raises(ValueError, match="'swish'.*relu, gelu"):
        tiny_model(activation="swish")


def test_share_embeddings_needs_equal_vocab_sizes():
    with pytest.raises(ValueError, match="src_vocab_size=40 != tgt_vocab_size=50"):
        tiny_model(tgt_vocab_size=50)
    model = tiny_model(tgt_vocab_size=50, share_embeddings=False)
    assert model(random_src(2, 4), torch.tensor([[BOS], [BOS]])).shape == (2, 1, 50)


def test_embedding_tying():
    shared = tiny_model()
    w = shared.encoder_embedding.token.weight
    assert shared.decoder_embedding.token.weight is w
    assert shared.output_projection.weight is w
    untied = tiny_model(share_embeddings=False, tie_output=True)
    assert untied.decoder_embedding.token.weight is not untied.encoder_embedding.token.weight
    assert untied.output_projection.weight is untied.decoder_embedding.token.weight
    separate = tiny_model(share_embeddings=False, tie_output=False)
    assert separate.output_projection.weight is not separate.decoder_embedding.token.weight
    # Tied matrices are counted once.
    E, V = 32, VOCAB
    assert separate.num_parameters() - shared.num_parameters() == 2 * V * E


def test_pad_rows_of_embeddings_start_at_zero():
    model = tiny_model(share_embeddings=False, tie_output=False)
    assert torch.all(model.encoder_embedding.token.weight[PAD] == 0)
    assert torch.all(model.decoder_embedding.token.weight[PAD] == 0)


def test_per_sublayer_attention_overrides_reach_their_layers():
    model = tiny_model(
        attention={"num_heads": 4, "backend": "math"},
        decoder_self_attention={"num_kv_heads": 1},
        cross_attention={"num_kv_heads": 2, "backend": "sdpa"},
    )
    for layer in model.encoder_layers:
        assert (layer.self_attn.num_kv_heads, layer.self_attn.backend) == (4, "math")
    for layer in model.decoder_layers:
        assert (layer.self_attn.num_kv_heads, layer.self_attn.backend) == (1, "math")
        assert (layer.cross_attn.num_kv_heads, layer.cross_attn.backend) == (2, "sdpa")
    dense = {"active_head_fraction": 1.0}
    assert model.head_config == {
        "encoder_self_attention": {
            "kind": "mha",
            "num_heads": 4,
            "num_kv_heads": 4,
            "backend": "math",
            "tag": "mha4",
            **dense,
        },
        "decoder_self_attention": {
            "kind": "mqa",
            "num_heads": 4,
            "num_kv_heads": 1,
            "backend": "math",
            "tag": "mqa4",
            **dense,
        },
        "cross_attention": {
            "kind": "gqa",
            "num_heads": 4,
            "num_kv_heads": 2,
            "backend": "sdpa",
            "tag": "gqa4kv2",
            **dense,
        },
    }
    assert model.head_tag == "enc-mha4_dec-mqa4_cross-gqa4kv2_math-sdpa"


def test_head_designs_reach_their_layers_and_aux_losses_sum():
    moh = {"design": "moh", "design_options": {"top_k_heads": 2, "num_shared_heads": 1}}
    model = tiny_model(
        attention={"num_heads": 4, **moh},
        decoder_self_attention={"num_kv_heads": 2},
        cross_attention={"design_options": {"top_k_heads": 1}},  # the shared head inherited
    )
    assert model.head_tag == "enc-mha4-moh-k2s1_dec-gqa4kv2-moh-k2s1_cross-mha4-moh-k1s1_sdpa"
    assert model.head_config["cross_attention"]["active_head_fraction"] == 0.5
    src, tgt_in = torch.randint(1, VOCAB, (2, 7)), torch.randint(1, VOCAB, (2, 5))
    model.train()(src, tgt_in)
    layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    by_hand = sum(m.aux_loss.item() for m in layers)
    assert len(layers) == 6 and model.aux_loss().item() == pytest.approx(by_hand, rel=1e-6)
    model.eval()(src, tgt_in)
    assert model.aux_loss() is None
    assert tiny_model().train().aux_loss() is None
    mixed = tiny_model(attention={"num_heads": 4, "design": "talking_heads", "backend": "math"})
    assert mixed.head_config["encoder_self_attention"]["tag"] == "mha4-talking_heads"


def test_a_sublayer_naming_another_design_takes_that_designs_options_alone():
    """Its design_options are not merged with the top level's, which its design does not take."""
    moh = {"design": "moh", "design_options": {"top_k_heads": 2, "num_shared_heads": 1}}
    mixing = {"design": "group_mlp", "design_options": {"mixing_groups": 4}}
    model = tiny_model(attention={"num_heads": 4, **moh}, decoder_self_attention=mixing)
    tags = {kind: config["tag"] for kind, config in model.head_config.items()}
    assert tags == {
        "encoder_self_attention": "mha4-moh-k2s1",
        "decoder_self_attention": "mha4-group_mlp4",
        "cross_attention": "mha4-moh-k2s1",
    }
    assert model.decoder_layers[0].self_attn.design.groups == 4


@pytest.mark.parametrize(
    "attention, message",
    [
        (
            {"top_k_heads": 2},
            r"unknown key\(s\) \['top_k_heads'\] in attention;.*attention.design_o",
        ),
        (
            {"num_kv_headz": 1},
            r"unknown key\(s\) \['num_kv_headz'\] in attention \(num_kv_headz: closest "
            r"num_kv_heads\); expected",
        ),
        ({"design": "moh", "design_options": 2}, r"attention.design_options must be a mapping"),
        (
            {"design": "moh", "design_options": {"top_k_heads": 2, "num_kv_heads": 1}},
            r"attention.design_options has num_kv_heads, the layer's own: set attention.num_kv",
        ),
        ({"design_options": {"top_k_heads": 2}}, r"options top_k_heads are a head design's, an"),
    ],
)
def test_design_options_that_do_not_fit_are_named(attention, message):
    with pytest.raises(ValueError, match=message):
        tiny_model(attention={"num_heads": 4, **attention})


def test_parameter_and_cache_counts():
    model = tiny_model(decoder_self_attention={"num_kv_heads": 1})

    def layer(kv_heads: int) -> int:  # E = 32, 4 heads of 8: Q/K/V (+ biases), then W_O
        rows = 32 + 2 * kv_heads * 8
        return rows * 32 + rows + 32 * 32 + 32

    # 2 encoder and 2 cross-attention layers with 4 K/V heads, 2 decoder layers with one.
    assert model.attention_parameters() == 4 * layer(4) + 2 * layer(1)
    # Decoder self-attention, MQA: 2 layers * (K + V) * 1 head * head_dim 8 * 4 bytes.
    assert model.kv_cache_bytes_per_token() == 2 * 2 * 1 * 8 * 4
    assert model.kv_cache_bytes_per_token(torch.bfloat16) == 2 * 2 * 1 * 8 * 2
    assert model.cross_kv_cache_bytes_per_source_token() == 2 * 2 * 4 * 8 * 4


def test_padding_does_not_change_other_positions():
    model = tiny_model()
    src = random_src(1, 5)
    tgt = torch.randint(3, VOCAB, (1, 4))
    padded_src = torch.cat([src, torch.full((1, 3), PAD)], dim=1)
    padded_tgt = torch.cat([tgt, torch.full((1, 2), PAD)], dim=1)
    ref = model(src, tgt)
    out = model(padded_src, padded_tgt)[:, :4]
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("norm_first, positional", [(False, "sinusoidal"), (True, "sinusoidal"),
    (False, "rope")])  # fmt: skip
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_incremental_decoding_matches_full_forward(norm_first, positional, variant):
    model = tiny_model(
        norm_first=norm_first,
        positional=positional,
        attention={"num_heads": 4, "num_kv_heads": VARIANTS[variant]},
    )
    B, S, T = 3, 7, 6
    src = random_src(B, S)
    tgt = torch.randint(3, VOCAB, (B, T))
    tgt[:, 0] = BOS
    full = model(src, tgt)
    memory, pad = model.encode(src)
    caches = model.make_decoder_cache(B, T, S)
    # A prompt of 3 positions at once (causal mask within the chunk), then one at a time.
    steps = [model.decode(tgt[:, :3], memory, pad, caches)]
    for t in range(3, T):
        steps.append(model.decode(tgt[:, t : t + 1], memory, pad, caches, start_pos=t))
    assert caches.position == T
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)


def test_decoder_cache_select_and_reset():
    model = tiny_model()
    src = random_src(3, 5)
    tgt = torch.randint(3, VOCAB, (3, 4))
    full = model(src, tgt)
    memory, pad = model.encode(src)
    caches = model.make_decoder_cache(3, 4, 5)
    first = model.decode(tgt[:, :2], memory, pad, caches)
    assert torch.allclose(first, full[:, :2], atol=1e-5)
    keep = torch.tensor([2, 0])
    caches.select(keep, keep)  # self rows, then sentences (cross rows)
    rest = model.decode(tgt[keep, 2:], memory[keep], pad[keep], caches)
    assert caches.batch_size == 2
    assert torch.allclose(rest, full[keep, 2:], atol=1e-5)
    caches.reset()
    assert caches.position == 0


def test_target_rows_can_share_memory_rows():
    """k target rows per memory row (the beams of a sentence) decode as with the memory repeated."""
    model = tiny_model(decoder_self_attention={"num_kv_heads": 1})
    src = random_src(2, 5, min_len=3)
    tgt = torch.randint(3, VOCAB, (6, 4))  # 3 rows per sentence
    memory, pad = model.encode(src)
    repeated_maps, shared_maps = [], []
    repeated = model.decode(
        tgt, memory.repeat_interleave(3, 0), pad.repeat_interleave(3, 0), maps=repeated_maps
    )
    shared = model.decode(tgt, memory, pad, maps=shared_maps)
    assert torch.allclose(shared, repeated, atol=1e-5)
    for a, b in zip(shared_maps, repeated_maps, strict=True):
        assert torch.allclose(a["cross"], b["cross"], atol=1e-6)  # (6, H, 4, S) both
    caches = model.make_decoder_cache(6, 4, 5, num_sentences=2)
    steps = [model.decode(tgt[:, t : t + 1], memory, pad, caches) for t in range(4)]
    assert caches.cross_caches[0].batch_size == 2  # the memory's K/V once per sentence
    assert torch.allclose(torch.cat(steps, dim=1), repeated, atol=1e-5)
    with pytest.raises(ValueError, match="N dividing the 6 rows of tgt_in"):
        model.decode(tgt, memory[[0, 1, 0, 1]], pad[[0, 1, 0, 1]])


def test_start_pos_must_agree_with_cache():
    model = tiny_model()
    memory, pad = model.encode(random_src(1, 3))
    caches = model.make_decoder_cache(1, 4, 3)
    with pytest.raises(ValueError, match="start_pos=2 disagrees with the 0 positions"):
        model.decode(torch.tensor([[BOS]]), memory, pad, caches, start_pos=2)


def test_attention_maps_shapes_and_normalisation():
    model = tiny_model(decoder_self_attention={"num_kv_heads": 1})
    src = random_src(2, 6, min_len=3)
    tgt = torch.randint(3, VOCAB, (2, 4))
    with torch.no_grad():
        maps = model.attention_maps(src, tgt)
    assert [m.shape for m in maps["encoder_self"]] == [(2, 4, 6, 6)] * 2
    assert [m.shape for m in maps["decoder_self"]] == [(2, 4, 4, 4)] * 2
    assert [m.shape for m in maps["cross"]] == [(2, 4, 4, 6)] * 2
    for kind in maps.values():
        for weights in kind:
            assert torch.allclose(weights.sum(-1), torch.ones(()), atol=1e-5)
    pad = src.eq(PAD)[:, None, None, :]
    assert torch.all(maps["cross"][0].masked_select(pad) == 0)
    assert torch.all(maps["decoder_self"][1].triu(1) == 0)


def test_constructor_is_keyword_only_with_plain_values():
    with pytest.raises(TypeError):
        Transformer(VOCAB, VOCAB)  # type: ignore[misc]


def test_flash_on_a_padded_sublayer_refuses_when_the_model_is_built():
    with pytest.raises(ValueError, match=r"encoder_self_attention backend 'flash'.*efficient"):
        tiny_model(attention={"num_heads": 4, "backend": "flash"})
    with pytest.raises(ValueError, match=r"cross_attention backend 'flash'"):
        tiny_model(cross_attention={"backend": "flash"})
    model = tiny_model(decoder_self_attention={"backend": "flash"})  # causal, unpadded keys
    assert model.head_config["decoder_self_attention"]["backend"] == "flash"


def test_head_config_and_tag_describe_every_layer_after_per_layer_pruning():
    model = tiny_model()
    path = "decoder_layers.1.self_attn"
    model.set_submodule(path, prune_heads(model.get_submodule(path), [0]))
    decoder = model.head_config["decoder_self_attention"]
    assert (decoder["num_heads"], decoder["num_kv_heads"], decoder["tag"]) == (
        "4+3",
        "4+3",
        "mha4+mha3",
    )
    assert decoder["kind"] == "mha" and model.head_config["cross_attention"]["num_heads"] == 4
    assert model.head_tag == "enc-mha4_dec-mha4+mha3_cross-mha4_sdpa"


def test_alibi_biases_both_self_attentions_and_is_refused_with_rotary_dim():
    model = tiny_model(positional="alibi")
    for layer in [*model.encoder_layers, *model.decoder_layers]:
        assert isinstance(layer.self_attn.positions, ALiBi)
        assert layer.self_attn.positions.num_heads == 4
        assert getattr(layer, "cross_attn", None) is None or layer.cross_attn.positions is None
    assert model.encoder_embedding.positional is None  # nothing added to the embeddings
    assert model.head_config["decoder_self_attention"]["alibi"] is True
    with pytest.raises(ValueError, match="rotary_dim=4 is not used with positional='alibi'"):
        tiny_model(positional="alibi", attention={"num_heads": 4, "rotary_dim": 4})


def test_rope_rotates_both_self_attentions_and_is_refused_elsewhere():
    model = tiny_model(positional="rope", attention={"num_heads": 4, "rotary_dim": 4})
    for layer in [*model.encoder_layers, *model.decoder_layers]:
        assert layer.self_attn.positions.rotary_dim == 4
        assert getattr(layer, "cross_attn", None) is None or layer.cross_attn.positions is None
    assert model.encoder_embedding.positional is None  # nothing added to the embeddings
    assert tiny_model(positional="rope").encoder_layers[0].self_attn.positions.rotary_dim == 8
    with pytest.raises(ValueError, match="rotary_dim=8 is not used with positional='sinusoidal'"):
        tiny_model(attention={"num_heads": 4, "rotary_dim": 8})
    with pytest.raises(ValueError, match="cross_attention: rotary_dim=8 is not used with cross"):
        tiny_model(positional="rope", cross_attention={"rotary_dim": 8})
    with pytest.raises(ValueError, match="start_pos=2 without caches"):
        model.decode(torch.tensor([[BOS]]), *model.encode(random_src(1, 3)), start_pos=2)


def test_differential_layers_get_the_papers_lambda_init_of_their_depth():
    # Ye et al., section 2.1: lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1)), l = 1 .. L per stack.
    model = tiny_model(num_encoder_layers=3, attention={"num_heads": 4, "design": "diff"})
    for _, depth, _, attn in model.attention_sublayers():
        assert attn.design.lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-0.3 * depth))
    assert model.head_config["encoder_self_attention"]["tag"] == "mha4-diff"
    fixed = tiny_model(
        attention={"num_heads": 4, "design": "diff", "design_options": {"lambda_init": 0.8}}
    )
    assert {attn.design.lambda_init for *_, attn in fixed.attention_sublayers()} == {0.8}
    x, y = random_src(2, 5), torch.randint(3, VOCAB, (2, 4))
    assert model(x, y).shape == (2, 4, VOCAB)
