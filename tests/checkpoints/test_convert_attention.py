"""convert_attention: one call converts every attention layer of our Transformer (rope
included), of a model swapped by replace_torch_attention and of an HF Llama swapped by
replace_hf_attention; each is checked against the model before the conversion."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn

from multihead import replace_torch_attention
from multihead.checkpoints.conversion import convert_attention
from multihead.model import Transformer

transformers = pytest.importorskip("transformers")
from multihead.integrations import huggingface as hf  # noqa: E402


def rope_transformer() -> Transformer:
    torch.manual_seed(0)
    args = dict(src_vocab_size=50, tgt_vocab_size=50, d_model=32, ffn_dim=32,
                num_encoder_layers=2, num_decoder_layers=2, positional="rope", dropout=0.0,
                max_positions=64,
                attention={"num_heads": 4, "num_kv_heads": 2})  # fmt: skip
    return Transformer(**args).double().eval(), args


def test_a_rope_transformer_converts_exactly_at_full_rank_and_its_config_rebuilds_it():
    model, args = rope_transformer()
    batch = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 5))
    with torch.no_grad():
        want = model(*batch)
    # "norm" picks each layer's own pairs, which one config per sublayer kind cannot hold:
    # refused before any layer is replaced.
    with pytest.raises(ValueError, match="decoder_self_attention layers would get different"):
        convert_attention(model, kv_latent=8, rope_dim=2, selection="norm", calibration=batch)
    assert model.head_config["decoder_self_attention"]["tag"] == "gqa4kv2-rope"
    # Both self-attentions: 2 groups of D = 8 features, all rotated (rope_dim None: all 8
    # kept), so the latent holds V alone: full rank is 2 * 8, the cache 16 + 2 * 8 = 32 floats.
    scope = ["encoder_self_attention", "decoder_self_attention"]
    report = convert_attention(model, kv_latent=16, calibration=batch, scope=scope)
    assert [row["layer"] for row in report] == [
        f"{stack}_layers.{i}.self_attn" for stack in ("encoder", "decoder") for i in (0, 1)
    ]
    assert all(row["k_error"] < 1e-12 and row["v_error"] < 1e-12 for row in report)
    assert [(row["bytes_before"], row["bytes_after"]) for row in report] == [(128, 128)] * 4
    with torch.no_grad():
        torch.testing.assert_close(model(*batch), want, rtol=0, atol=1e-10)
    config = model.attention_config["decoder_self_attention"]
    own = config["design_options"]
    assert config["design"] == "mla" and config["rotary_dim"] == 8 and own["rope_kv_heads"] == 2
    assert own["qk_head_dim"] == 0
    # The rewritten config builds the same architecture: the state_dict loads and computes.
    rebuilt = Transformer(**args, **{k: model.attention_config[k] for k in scope})
    rebuilt.double().eval().load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(*batch), want, rtol=0, atol=1e-10)


def test_a_torch_model_swapped_by_replace_torch_attention_converts_and_reports_its_errors():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = replace_torch_attention(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))
    model = model.double().eval()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    with torch.no_grad():
        want = model(x)
    pooled = copy.deepcopy(model)
    # K/V pooled to 1 head: the error of K, written out from the first layer's weights and input.
    report = convert_attention(pooled, kv_heads=1, calibration=x)
    w_k = model.layers[0].self_attn.attn.in_proj.weight[32:64]  # (4 heads * 8, 32)
    k = x @ w_k.T  # (B, S, 32)
    mean = k.view(2, 6, 4, 8).mean(2, keepdim=True).expand(2, 6, 4, 8).reshape(2, 6, 32)
    assert report[0]["layer"] == "layers.0.self_attn.attn"
    assert report[0]["k_error"] == pytest.approx(((k - mean).norm() / k.norm()).item(), rel=1e-9)
    assert (report[0]["bytes_before"], report[0]["bytes_after"]) == (256, 64)
    # scope chooses among our Transformer's sublayers; here it would be ignored, so it is refused.
    for scope in ("all", "decoder"):  # "decoder", our Transformer's default, too
        with pytest.raises(ValueError, match=f"scope='{scope}' is for our Transformer; in a Tr"):
            convert_attention(copy.deepcopy(model), kv_heads=1, scope=scope)
    # A latent of the K/V stack's full rank (E = 32): the same model, no error.
    report = convert_attention(model, kv_latent=32, calibration=x)
    assert all(row["k_error"] < 1e-12 and row["v_error"] < 1e-12 for row in report)
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=0, atol=1e-10)


def test_an_hf_llama_swapped_by_replace_hf_attention_converts_and_still_generates():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
        eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    source = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float64
    ).eval()
    model = hf.replace_hf_attention(source)
    swapped = copy.deepcopy(model)  # the reference (HF's own angles are fp32: 1e-8 away)
    ids = torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    # Partial RoPE, 2 of 4 pairs kept by "norm": the model changes (2 pairs stop turning),
    # but at full rank (K's 2 * 4 unrotated features and V's 2 * 8) K and V before RoPE do not.
    partial = copy.deepcopy(swapped)
    report = convert_attention(partial, kv_latent=24, rope_dim=4, selection="norm", calibration=ids)
    assert all(row["k_error"] < 1e-12 and row["v_error"] < 1e-12 for row in report)
    assert [row["bytes_after"] for row in report] == [(24 + 2 * 4) * 4] * 2
    # GQA, 2 groups of D = 8 features all rotated: every one kept, the latent holds V (16).
    report = convert_attention(model, kv_latent=16, calibration=ids)
    assert len(report) == 2 and all(row["k_error"] < 1e-12 for row in report)
    assert model.model.layers[0].self_attn.attn.head_tag == "mla4r16rope8x2"
    with torch.no_grad():
        want = swapped(ids).logits
        torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=1e-10)
        # Greedy decoding through HF's cache equals the argmax of full passes, step by step.
        out = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=True)
        for t in range(8, 13):
            assert torch.equal(out[:, t], model(out[:, :t]).logits[:, -1].argmax(-1))


# ---------------------------------------------------------------------- refusals, each named
def swapped_encoder() -> nn.Module:
    """Two torch encoder layers swapped to MultiHeadAttention: MHA, E = 32, 4 heads of 8."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return replace_torch_attention(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))


def test_a_model_never_swapped_is_refused_naming_the_swap():
    """It returned [] (the model unchanged, in silence)."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with pytest.raises(
        ValueError, match=r"LlamaForCausalLM has no MultiHeadAttention to convert; swap its "
        r"attention first \(replace_hf_attention for a Hugging Face model"
    ):  # fmt: skip
        convert_attention(model, kv_heads=1)


def test_an_already_converted_model_is_refused_as_such():
    """It got "none in scope has positions", as a model with no attention at all did."""
    model, _ = rope_transformer()
    convert_attention(model, kv_latent=16)
    with pytest.raises(
        ValueError, match=r"^decoder_layers.0.self_attn already has a K/V latent "
        r"\('mla4r16rope8x2'\), which kv_latent=8 does not convert; it converts MHA/GQA/MQA"
    ):  # fmt: skip
        convert_attention(model, kv_latent=8, rope_dim=2)


def test_options_it_would_ignore_are_refused_by_name():
    """rope_dim and selection were accepted with kv_heads and did nothing."""
    rope, _ = rope_transformer()
    with pytest.raises(
        ValueError, match=r"^rope_dim=4 and selection='norm' would be ignored: kv_heads=1 pools "
        r"K/V heads, and they choose the rotary features of a K/V latent$"
    ):  # fmt: skip
        convert_attention(rope, kv_heads=1, rope_dim=4, selection="norm")
    with pytest.raises(
        ValueError, match=r"^selection='uniform' would be ignored: they choose rotary features, "
        r"and no layer in scope has positions$"
    ):  # fmt: skip
        convert_attention(swapped_encoder(), kv_latent=8, selection="uniform")


def test_refusals_name_the_arguments_as_passed():
    """kv_heads=0 was refused as num_kv_heads, kv_latent=0 as kv_latent_dim."""
    model = swapped_encoder()
    with pytest.raises(ValueError, match=r"^kv_heads must be a positive integer, got kv_heads=0$"):
        convert_attention(model, kv_heads=0)
    with pytest.raises(ValueError, match=r"^kv_latent must be a positive integer, got kv_lat"):
        convert_attention(model, kv_latent=0)
    with pytest.raises(ValueError, match=r"^cannot pool 4 K/V heads into 3: it must divide 4$"):
        convert_attention(model, kv_heads=3)


@pytest.mark.parametrize(
    "shape", [(2, 6, 16), (1, 2, 6, 32)], ids=["width", "rank"]
)  # fmt: skip
def test_a_calibration_batch_of_the_wrong_shape_is_refused_naming_the_shape(shape):
    """A raw matmul error came from inside the layer."""
    with pytest.raises(
        ValueError, match=re.escape(f"calibration gives layers.0.self_attn.attn an input of "
                                    f"shape {shape}, where it reads (B, S, 32)")
    ):  # fmt: skip
        convert_attention(swapped_encoder(), kv_heads=2, calibration=torch.randn(shape))


def test_keeping_every_rotary_feature_warns_nothing():
    """Q/K all rotary leaves the latent's Q projection no rows: nn.Linear's init warned
    "Initializing zero-element tensors is a no-op" at every conversion."""
    model, _ = rope_transformer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_attention(model, kv_latent=16)  # rope_dim unset: all 8 rotated features kept
    assert model.decoder_layers[0].self_attn.in_proj.weight.shape == (0, 32)
