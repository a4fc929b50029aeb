"""convert_attention: one call converts every attention layer of our Transformer (rope
included), of a model swapped by replace_torch_attention and of an HF Llama swapped by
replace_hf_attention; each is checked against the model before the conversion."""

from __future__ import annotations

import copy

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
    assert config["rotary_dim"] == 8 and config["rope_kv_heads"] == 2
    assert config["qk_head_dim"] == 0
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
