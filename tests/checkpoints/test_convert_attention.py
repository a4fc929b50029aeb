"""convert_attention: one call converts every attention layer of our Transformer (rope
included), of a model swapped by replace_torch_attention and of an HF Llama swapped by
replace_hf_attention; each is checked against the model before the conversion."""

from __future__ import annotations

import copy
import itertools
import logging
import re
import warnings

import pytest
import torch
from torch import nn

from multihead import MultiHeadAttention, replace_torch_attention
from multihead.attention import with_kv_latent
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


def _swapped_llama() -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """A tiny fp64 HF Llama (4 heads of 8, 2 K/V groups, every feature rotated) swapped by
    replace_hf_attention, an untouched copy of it (the reference: HF's own angles are fp32,
    1e-8 away) and 2 x 8 token ids."""
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
    ids = torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    return model, copy.deepcopy(model), ids


def test_an_hf_llama_swapped_by_replace_hf_attention_converts_and_still_generates():
    model, swapped, ids = _swapped_llama()
    # Partial RoPE, 2 of 4 pairs kept by "norm": the model changes (2 pairs stop turning),
    # but at full rank (K's 2 * 4 unrotated features and V's 2 * 8) K and V before RoPE do not.
    partial = copy.deepcopy(swapped)
    report = convert_attention(partial, kv_latent=24, rope_dim=4, selection="norm",
                               rotary_key="per_group", calibration=ids)  # fmt: skip
    assert all(row["k_error"] < 1e-12 and row["v_error"] < 1e-12 for row in report)
    assert [row["bytes_after"] for row in report] == [(24 + 2 * 4) * 4] * 2
    # GQA, 2 groups of D = 8 features all rotated: every one kept, the latent holds V (16).
    report = convert_attention(model, kv_latent=16, calibration=ids)
    assert len(report) == 2 and all(row["k_error"] < 1e-12 for row in report)
    # every K feature rotated (qk0), and a digest of the source's scale and frequencies
    tag = model.model.layers[0].self_attn.attn.head_tag
    assert re.fullmatch(r"mla4r16rope8x2qk0-[0-9a-f]{6}", tag), tag
    with torch.no_grad():
        want = swapped(ids).logits
        torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=1e-10)
        # Greedy decoding through HF's cache equals the argmax of full passes, step by step.
        out = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=True)
        for t in range(8, 13):
            assert torch.equal(out[:, t], model(out[:, :t]).logits[:, -1].argmax(-1))


def test_an_hf_llama_with_one_shared_rotary_key_is_exact_when_it_drops_nothing_and_generates():
    """2 K/V groups of 8 rotated features: a shared key of 16 keeps every component, the
    latent (V and nothing of K) its 16: the model's logits, and greedy decoding through HF's
    cache equal to the argmax of full passes."""
    model, swapped, ids = _swapped_llama()
    report = convert_attention(model, kv_latent=16, rope_dim=16, rotary_key="shared",
                               calibration=ids)  # fmt: skip
    assert [row["bytes_after"] for row in report] == [(16 + 16) * 4] * 2
    assert all(row["out_error"] < 1e-10 for row in report)
    tag = model.model.layers[0].self_attn.attn.head_tag
    assert re.fullmatch(r"mla4r16rope16-[0-9a-f]{6}", tag), tag  # the source's scale, ...
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, swapped(ids).logits, rtol=0, atol=1e-10)
        out = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True)
        for t in range(8, 12):
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
        r"\('mla4r16rope8x2qk0-[0-9a-f]{6}'\), which kv_latent=8 does not convert; it converts "
        r"MHA/GQA/MQA"
    ):  # fmt: skip
        convert_attention(model, kv_latent=8, rope_dim=2)


def test_options_it_would_ignore_are_refused_by_name():
    """rope_dim and selection were accepted with kv_heads and did nothing."""
    rope, _ = rope_transformer()
    with pytest.raises(
        ValueError, match=r"^rope_dim=4 and selection='norm' would be ignored: kv_heads=1 pools "
        r"K/V heads, and they shape a K/V latent$"
    ):  # fmt: skip
        convert_attention(rope, kv_heads=1, rope_dim=4, selection="norm")
    with pytest.raises(
        ValueError, match=r"^rotary_key='shared' and factorisation='pca' and balance_kv=True would "
        r"be ignored: kv_heads=1 pools"
    ):  # fmt: skip
        convert_attention(
            rope, kv_heads=1, rotary_key="shared", factorisation="pca", balance_kv=True
        )
    with pytest.raises(ValueError, match=r"^freqfold=2 would be ignored: they choose rotary"):
        convert_attention(swapped_encoder(), kv_latent=8, freqfold=2)
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
        ValueError, match=re.escape(f"calibration {shape} torch.float32 gives layers.0.self_attn."
                                    f"attn an input of shape {shape}, where it reads (B, S, 32)")
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


# ------------------------------------------------------------------ calibration (issue 67)
class OneLayer(nn.Module):
    """A rotary layer called causally, the smallest model convert_attention takes."""

    def __init__(self, attn: MultiHeadAttention) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x):
        return self.attn(x, is_causal=True)


def test_a_list_of_batches_calibrates_on_every_real_token_and_no_padding():
    """Cross-attention's K/V source is the memory: its padded positions (key_padding_mask)
    are left out. The reference: with_kv_latent on the real memory rows, gathered here."""
    model, _ = rope_transformer()
    pad = model.pad_id
    batches = [(torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 5))),
               (torch.randint(4, 50, (2, 4)), torch.randint(4, 50, (2, 6)))]  # fmt: skip
    batches[0][0][0, 5:] = pad  # padding in the first batch's sources
    memories = []
    with torch.no_grad():
        for src, _ in batches:
            memory, src_pad = model.encode(src)
            memories.append(memory[~src_pad])  # (real tokens, E)
    reference = with_kv_latent(model.decoder_layers[0].cross_attn, 12, factorisation="pca",
                               calibration=torch.cat(memories))  # fmt: skip
    # Every choice named: nothing measured, every batch fitted.
    report = convert_attention(model, kv_latent=12, calibration=batches, factorisation="pca",
                               balance_kv=False, scope=["cross_attention"])  # fmt: skip
    assert all("candidates" not in row for row in report)
    converted = model.decoder_layers[0].cross_attn
    torch.testing.assert_close(converted.kv_latent.down.weight, reference.kv_latent.down.weight)
    torch.testing.assert_close(converted.kv_latent.up.weight, reference.kv_latent.up.weight)
    assert [row["layer"] for row in report] == [f"decoder_layers.{i}.cross_attn" for i in (0, 1)]


def test_the_shared_keys_errors_are_those_of_the_latent_and_of_the_output():
    """k_error: the pre-RoPE K of the converted layer in the source's basis (the latent's
    keys plus each pair's top component u_i u_i^T k_i, u_i written here from the outputs)
    against the source's; out_error: the layer's output against the source's, both on
    the calibration inputs."""
    G, D = 4, 8
    torch.manual_seed(3)
    source = MultiHeadAttention(32, 4, G, rotary_dim=8, dtype=torch.float64).eval()
    x = torch.randn(5, 9, 32, dtype=torch.float64)
    model = OneLayer(copy.deepcopy(source))
    (row,) = convert_attention(model, kv_latent=12, rope_dim=4 * 2, rotary_key="shared",
                               calibration=x, factorisation="pca", balance_kv=False)  # fmt: skip
    latent = model.attn.kv_latent
    rows = x.reshape(-1, 32)
    k = (rows @ source.in_proj.blocks()[1].detach().T).view(-1, G, D)  # (N, G, D)
    d = 1e-2 * rows.square().sum() / rows.numel()
    w_k = source.in_proj.blocks()[1].detach().view(G, D, 32)
    kept = torch.zeros_like(k)
    for i in range(4):  # "rotate half": pair i is features i and i + 4
        comps = k[:, :, [i, i + 4]]  # (N, G, 2)
        moment = torch.einsum("ngt,nht->gh", comps, comps) / len(rows)
        moment += d * torch.einsum("gte,hte->gh", w_k[:, [i, i + 4]], w_k[:, [i, i + 4]])
        u = torch.linalg.eigh(moment).eigenvectors[:, -1:]  # (G, 1)
        kept[:, :, [i, i + 4]] = torch.einsum("gj,hj,nht->ngt", u, u, comps)
    k_latent, v_latent = latent.expand(latent.latent(rows[None]))  # (1, H, N, D) each; H = G
    k_converted = k_latent[0].transpose(0, 1) + kept  # (N, G, D)
    want = ((k_converted - k).norm() / k.norm()).item()
    assert row["k_error"] == pytest.approx(want, rel=1e-6) and 0.01 < want < 1
    with torch.no_grad():
        out = source(x, is_causal=True)
        assert row["out_error"] == pytest.approx(
            ((model(x) - out).norm() / out.norm()).item(), rel=1e-9
        )


@pytest.mark.parametrize(
    ("calibration", "message"),
    [
        ({"input_id": "ids"}, r"^calibration \{'input_id': \(2, 8\) torch.int64\} does not run "
         r"LlamaForCausalLM: .*input_id"),
        ("floats", r"^calibration \(2, 8\) torch.float32 gives model.embed_tokens \(an "
         r"embedding\) floats where it reads token ids: pass the token ids \(integers\), not "
         r"floats$"),
    ],
    ids=["wrong_key", "float_ids"],
)  # fmt: skip
def test_bad_calibration_is_refused_in_one_line_before_any_layer_changes(calibration, message):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )  # fmt: skip
    model = hf.replace_hf_attention(
        transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    )
    ids = torch.randint(2, 64, (2, 8))
    if isinstance(calibration, dict):  # its values are the ids
        calibration = {k: ids for k in calibration}
    elif isinstance(calibration, str):
        calibration = ids.float()
    with pytest.raises(ValueError, match=message):
        convert_attention(model, kv_latent=8, calibration=calibration)
    assert model.model.layers[0].self_attn.attn.head_tag == "mha4-rope"


def test_a_layer_the_calibration_never_reaches_is_refused_by_name():
    class TwoLayers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = MultiHeadAttention(32, 4), MultiHeadAttention(32, 4)

        def forward(self, x):
            return self.used(x)

    with pytest.raises(ValueError, match=r"^calibration never reaches unused: pass the model's"):
        convert_attention(TwoLayers(), kv_latent=8, calibration=torch.randn(2, 5, 32))


# -------------------------------------- the latent's choices, measured on held-out calibration
def held_out_error(source, converted, x):
    """The relative Frobenius error of ``converted``'s causal output against ``source``'s."""
    with torch.no_grad():
        want = source(x, is_causal=True)
        return ((converted(x, is_causal=True) - want).norm() / want.norm()).item()


def isotropic_layer_and_inputs(seed):
    """Inputs of no preferred direction (N(0, I)), few of them: the weights' SVD is the PCA
    of their true distribution, and the PCA of 24 samples in E = 32 adds only its noise."""
    torch.manual_seed(seed)
    layer = MultiHeadAttention(32, 4, dtype=torch.float64).eval()
    return layer, torch.randn(8, 4, 32, dtype=torch.float64)


def subspace_layer_and_inputs(seed):
    """Inputs near a 4-dimensional subspace (plus 5% noise), K weights 3x V's: what the
    latent must carry lies where the inputs are, not where the weights are largest."""
    torch.manual_seed(seed)
    layer = MultiHeadAttention(32, 4, dtype=torch.float64).eval()
    with torch.no_grad():
        layer.in_proj.blocks()[1].mul_(3)
    basis = torch.randn(4, 32, dtype=torch.float64)
    x = torch.randn(8, 4, 4, dtype=torch.float64) @ basis
    return layer, x + 0.05 * torch.randn(8, 4, 32, dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_default_keeps_the_factorisation_with_the_lower_held_out_error_in_either_layer(seed):
    """Two layers where the SVD wins in one and the PCA in the other. The reference, written
    here: the calibration's last quarter of sequences (2 of 8) held out, each factorisation
    fitted on the rest by with_kv_latent and scored by the layer's output error on the held-out
    sequences. The default's layer is within 2% of the better one's error, the report names
    it, its candidates' scores are those errors, and the layer kept is that choice fitted
    again on all 8 sequences, as naming it gives."""
    winners = {}
    for name, build in [("isotropic", isotropic_layer_and_inputs),
                        ("subspace", subspace_layer_and_inputs)]:  # fmt: skip
        source, x = build(seed)
        fit, held = x[:6], x[6:]
        errors = {}
        for f in ("svd", "pca"):
            named = with_kv_latent(source, 8, factorisation=f,
                                   calibration=fit if f == "pca" else None)  # fmt: skip
            errors[f] = held_out_error(source, named, held)
        model = OneLayer(copy.deepcopy(source))
        (row,) = convert_attention(model, kv_latent=8, balance_kv=False, calibration=x)
        best = min(errors, key=errors.get)
        assert held_out_error(source, model.attn, held) <= 1.02 * errors[best]
        assert row["latent"] == {"kv_latent": 8, "factorisation": best, "balance_kv": False}
        refit = with_kv_latent(source, 8, factorisation=best,
                               calibration=x if best == "pca" else None)  # fmt: skip
        with torch.no_grad():
            torch.testing.assert_close(model.attn(x, is_causal=True), refit(x, is_causal=True))
        assert row["scored_by"] == "held-out out_error"
        scores = {c["factorisation"]: c["score"] for c in row["candidates"]}
        assert scores == pytest.approx(errors, rel=1e-9)
        winners[name] = best
        print(name, errors)
    assert winners == {"isotropic": "svd", "subspace": "pca"}


def test_with_the_whole_model_the_choices_are_scored_by_its_held_out_loss_and_logged(caplog):
    """An HF Llama and token ids: the first layer's eight candidates (SVD or PCA, with or
    without BKV, per-group keys of 2 or one shared key of 2 x 2) scored by the model's loss on
    the 2 held-out sequences of 8, the other layer as it was. The reference: each candidate
    built by with_kv_latent on that layer's inputs over the 6 fitting sequences and put in a
    copy of the model, scored by HF's own loss (labels = the ids)."""
    model, swapped, _ = _swapped_llama()
    ids = torch.randint(2, 64, (8, 8), generator=torch.Generator().manual_seed(2))
    fit, held = ids[:6], ids[6:]
    first = swapped.model.layers[0].self_attn.attn
    inputs = []
    handle = first.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
    with torch.no_grad():
        swapped(fit)
    handle.remove()
    want = {}
    for f, balance, key in itertools.product(("svd", "pca"), (False, True),
                                             ("per_group", "shared")):  # fmt: skip
        width = 2 if key == "per_group" else 4  # the same cache: r = 6 beside 4 numbers
        layer = with_kv_latent(first, 6, factorisation=f, balance_kv=balance, rotary_key=key,
                               rope_dim=width,
                               calibration=inputs[0] if f == "pca" else None)  # fmt: skip
        candidate = copy.deepcopy(swapped)
        candidate.model.layers[0].self_attn.attn = layer
        with torch.no_grad():
            want[f, balance, key, width, 6] = candidate(held, labels=held).loss.item()
    with caplog.at_level(logging.INFO, logger="multihead.checkpoints.conversion"):
        report = convert_attention(model, kv_latent=6, rope_dim=2, calibration=ids)
    row = report[0]
    assert row["scored_by"] == "held-out loss" and "budget_bytes" not in row
    # Named kv_latent and rope_dim: these eight candidates exactly, no other width (issue 84).
    got = {(c["factorisation"], c["balance_kv"], c["rotary_key"], c["rope_dim"],
            c["kv_latent"]): c["score"] for c in row["candidates"]}  # fmt: skip
    assert got == pytest.approx(want, rel=1e-6)  # HF's loss: fp32 logits, ours fp64
    best = min(want, key=want.get)
    assert tuple(row["latent"][k] for k in ("factorisation", "balance_kv", "rotary_key",
                                           "rope_dim", "kv_latent")) == best  # fmt: skip
    (line,) = [r.getMessage() for r in caplog.records if "convert_attention kept" in r.message]
    assert line.startswith(
        "convert_attention kept, by the loss on 2 of 8 sequences of the calibration held out: "
        "model.layers.0.self_attn.attn "
    )
    assert "model.layers.1.self_attn.attn" in line and "\n" not in line


def test_named_choices_are_used_as_they_are_with_every_batch_fitted():
    """factorisation, balance_kv and rotary_key all named: no candidates, no split; the layer
    is with_kv_latent's on all the calibration inputs."""
    model, swapped, _ = _swapped_llama()
    ids = torch.randint(2, 64, (4, 8), generator=torch.Generator().manual_seed(3))
    first = swapped.model.layers[0].self_attn.attn
    inputs = []
    handle = first.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
    with torch.no_grad():
        swapped(ids)
    handle.remove()
    reference = with_kv_latent(first, 6, rope_dim=4, rotary_key="shared", factorisation="pca",
                               balance_kv=True, calibration=inputs[0])  # fmt: skip
    report = convert_attention(model, kv_latent=6, rope_dim=4, rotary_key="shared",
                               factorisation="pca", balance_kv=True, calibration=ids)  # fmt: skip
    assert all("candidates" not in row for row in report)
    assert report[0]["latent"] == {"kv_latent": 6, "factorisation": "pca", "balance_kv": True,
                                   "rotary_key": "shared", "rope_dim": 4}  # fmt: skip
    converted = model.model.layers[0].self_attn.attn.kv_latent
    torch.testing.assert_close(converted.down.weight, reference.kv_latent.down.weight)
    torch.testing.assert_close(converted.up.weight, reference.kv_latent.up.weight)


# --------------------------------------------------------- the last silent paths (issue 74)
def test_kv_heads_already_there_is_refused_naming_the_count():
    """512 -> 512 bytes in silence: a model already at 2 K/V heads converted to 2."""
    model = swapped_encoder()
    convert_attention(model, kv_heads=2)
    with pytest.raises(
        ValueError, match=r"^kv_heads=2 would leave layers.0.self_attn.attn as it is: it has 2 "
        r"K/V heads already$"
    ):  # fmt: skip
        convert_attention(model, kv_heads=2)


def test_token_ids_of_a_wrong_shape_get_a_public_error_naming_their_shape():
    """(B, S, 3) ids raised the private class _Refused."""
    model, _, _ = _swapped_llama()
    with pytest.raises(ValueError) as refused:
        convert_attention(model, kv_latent=6, rope_dim=2,
                          calibration=torch.randint(2, 64, (2, 8, 3)))  # fmt: skip
    assert type(refused.value) is ValueError
    assert str(refused.value).startswith("calibration (2, 8, 3) torch.int64 gives model.layers.0")
    assert model.model.layers[0].self_attn.attn.head_tag == "gqa4kv2-rope"


def test_calibration_it_cannot_split_or_a_bad_balance_kv_is_refused_in_one_line():
    model, _, ids = _swapped_llama()
    with pytest.raises(
        ValueError, match=r"^calibration \(1, 8\) torch.int64 is one sequence, which cannot be "
        r"split into a part to fit and a part to score the latent's choices on: pass two or "
        r"more, or name factorisation, balance_kv and rotary_key$"
    ):  # fmt: skip
        convert_attention(model, kv_latent=6, rope_dim=2, calibration=ids[:1])
    # All named: one sequence is enough (nothing is measured).
    convert_attention(copy.deepcopy(model), kv_latent=6, rope_dim=2, calibration=ids[:1],
                      factorisation="pca", balance_kv=False, rotary_key="per_group")  # fmt: skip
    # With a budget, the keys' width is measured too: the advice names rope_dim, and works.
    with pytest.raises(
        ValueError, match=r"is one sequence, .*: pass two or more, or name factorisation, "
        r"balance_kv, rotary_key and rope_dim$"
    ):  # fmt: skip
        convert_attention(model, cache_budget=0.5, calibration=ids[:1])
    (row, _) = convert_attention(copy.deepcopy(model), cache_budget=0.5, calibration=ids[:1],
                                 factorisation="svd", balance_kv=False, rotary_key="per_group",
                                 rope_dim=2)  # fmt: skip
    assert (row["latent"]["kv_latent"], row["bytes_after"]) == (16 - 2 * 2, 64)
    with pytest.raises(TypeError, match=r"^balance_kv must be a bool or None, got 'yes'$"):
        convert_attention(model, kv_latent=6, balance_kv="yes", calibration=ids)


# ------------------------------------------------------------- calibration's edges (issue 84)
def test_token_ids_of_any_integer_dtype_are_measured_alike():
    """int32 ids, which HF takes, crashed the measured default's loss ("expected target
    dtype to be Long"); int16 and uint8, which torch's embedding refuses, are the same ids:
    each gives int64's report, scores and choices."""
    ids = torch.randint(2, 64, (8, 8), generator=torch.Generator().manual_seed(2))
    reports = []
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        model, _, _ = _swapped_llama()
        reports.append(convert_attention(model, kv_latent=6, rope_dim=2, calibration=ids.to(dtype)))
    assert all(report == reports[0] for report in reports) and "candidates" in reports[0][0]


@pytest.mark.parametrize("how", ["latent", "budget"])
def test_naming_each_layers_reported_choice_rebuilds_that_layer_exactly(how):
    """The report gives every width a layer got: a measured shared key is G * rope_dim wide
    (2 x 2 here), and naming the reported choice in the same call gave a rope_dim-wide one,
    another cache and other weights. Each layer's reported latent, named over the call's
    arguments, rebuilds it: the same weights (bit for bit) and cache bytes."""
    _, swapped, _ = _swapped_llama()
    ids = torch.randint(2, 64, (8, 8), generator=torch.Generator().manual_seed(2))
    asked = {"latent": {"kv_latent": 6, "rope_dim": 2}, "budget": {"cache_budget": 0.5}}[how]
    model = copy.deepcopy(swapped)
    report = convert_attention(model, **asked, calibration=ids)
    assert all("candidates" in row for row in report)
    if how == "latent":  # the case named wrongly before: a shared key of 2 x 2, r = 6
        assert any(row["latent"]["rotary_key"] == "shared" for row in report)
    for i, row in enumerate(report):
        latent = row["latent"]
        cached = latent["kv_latent"] + latent["rope_dim"] * (
            2 if latent["rotary_key"] == "per_group" else 1
        )  # 2 K/V groups
        assert row["bytes_after"] == 4 * cached
        named = copy.deepcopy(swapped)
        arguments = {**asked, **latent} if how == "latent" else latent
        again = convert_attention(named, **arguments, calibration=ids)[i]
        assert "candidates" not in again and again["bytes_after"] == row["bytes_after"]
        want = named.model.layers[i].self_attn.attn.state_dict()
        got = model.model.layers[i].self_attn.attn.state_dict()
        assert want.keys() == got.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)


FIX = (
    r"pass the model's inputs \(an HF model's token ids \(B, S\), our Transformer's \(src, "
    r"tgt_in\)\), or calibration=None: the weights alone$"
)


@pytest.mark.parametrize(
    ("calibration", "message"),
    [
        ((), r"^calibration \(\) is empty: "),
        ({}, r"^calibration \{\} is empty: "),
        ([], r"^calibration \[\] is empty: "),
        ([[]], r"^calibration \[\[\]\] is empty: "),
        (torch.zeros(0, 8, dtype=torch.long), r"^calibration \(0, 8\) torch.int64 is empty: "),
        (torch.tensor(3), r"^calibration \(\) torch.int64 is one number, not a batch of "
         r"sequences: "),
    ],
    ids=["tuple", "mapping", "list", "list_of_list", "no_sequence", "0d"],
)  # fmt: skip
def test_empty_calibration_is_named_as_such_and_its_advice_works(calibration, message):
    """Empty calibration was "one sequence, which cannot be split", whose advice (name the
    choices) ended in HF's own error. Now it is named empty, and both fixes the line gives
    convert: the model's inputs, or calibration=None."""
    model, swapped, ids = _swapped_llama()
    with pytest.raises(ValueError, match=message + FIX):
        convert_attention(model, kv_latent=6, rope_dim=2, calibration=calibration)
    assert model.model.layers[0].self_attn.attn.head_tag == "gqa4kv2-rope"
    assert convert_attention(model, kv_latent=6, rope_dim=2, calibration=None)
    assert convert_attention(copy.deepcopy(swapped), kv_latent=6, rope_dim=2, calibration=ids)
    # With a budget whose split is measured, calibration is needed: the line says the one fix.
    with pytest.raises(
        ValueError, match=message + FIX.replace(", or calibration=None: the weights alone", "")
    ):
        convert_attention(swapped, cache_budget=0.5, calibration=calibration)


def test_an_array_or_ids_taken_for_a_mask_are_refused_with_a_fix_that_works():
    """A numpy array got the one-sequence message too; (ids, ids) spread over HF's forward
    made the second tensor the attention mask, in silence."""
    model, swapped, ids = _swapped_llama()
    ids = torch.randint(2, 64, (4, 8), generator=torch.Generator().manual_seed(3))
    with pytest.raises(TypeError, match=r"^calibration holds a ndarray where the model's inputs "
                       r"go: pass torch tensors \(torch.as_tensor\(x\) for an array\), a tuple or "
                       r"a mapping of them, or a list of such batches$"):  # fmt: skip
        convert_attention(model, kv_latent=6, rope_dim=2, calibration=ids.numpy())
    with pytest.raises(ValueError, match=r"^calibration \(\(4, 8\) torch.int64, \(4, 8\) "
                       r"torch.int64\) gives LlamaForCausalLM's attention_mask values other than "
                       r"0 and 1 \(\d+ to \d+\): a tuple goes to forward's arguments in order; "
                       r"pass the token ids alone, or \{'input_ids': ids, 'attention_mask': "
                       r"mask\}$"):  # fmt: skip
        convert_attention(model, kv_latent=6, rope_dim=2, calibration=(ids, ids))
    assert model.model.layers[0].self_attn.attn.head_tag == "gqa4kv2-rope"
    # The fixes, and a real 0/1 mask in a tuple, convert as the ids alone do.
    alone = convert_attention(copy.deepcopy(swapped), kv_latent=6, rope_dim=2, calibration=ids)
    mask = torch.ones_like(ids)
    for calibration in (torch.as_tensor(ids.numpy()), (ids, mask),
                        {"input_ids": ids, "attention_mask": mask}):  # fmt: skip
        got = convert_attention(copy.deepcopy(swapped), kv_latent=6, rope_dim=2,
                                calibration=calibration)  # fmt: skip
        assert [row["latent"] for row in got] == [row["latent"] for row in alone]


# ----------------------------------------------------------- a cache budget, measured (issue 84)
def budget_layer_and_inputs(positions_matter: bool, seed: int):
    """A rotary GQA layer (E = 64, 4 heads of D = 16, 2 K/V groups, all 16 features rotated,
    theta 4: every pair turns within the 16 positions) and 8 sequences of 16 N(0, I) inputs.
    ``positions_matter``: K turns in every pair and V has rank 2, so a wide rotary key keeps
    more of K turning and the latent still holds V; else K lives in pair 0 alone (features 0
    and 8 of each head), which the narrowest key keeps whole, and V has full rank: every
    number more in the latent counts."""
    torch.manual_seed(seed)
    attn = MultiHeadAttention(64, 4, 2, rotary_dim=16, rope_theta=4.0, dtype=torch.float64)
    _, w_k, w_v = attn.in_proj.blocks()
    with torch.no_grad():
        if positions_matter:
            low_rank = torch.randn(32, 2, dtype=torch.float64) @ torch.randn(2, 64).double()
            w_v.copy_(low_rank / 8)
        else:
            pair0 = torch.zeros(16, dtype=torch.bool)
            pair0[[0, 8]] = True
            w_k.mul_(pair0.repeat(2)[:, None])  # (2 groups * 16, E)
    return attn.eval(), torch.randn(8, 16, 64, dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("positions_matter", [False, True], ids=["pair0", "every_pair"])
def test_a_budget_spends_its_bytes_on_the_split_that_computes_best(positions_matter, seed):
    """128 bytes a token (1/2 of the layer's 2 groups x 2 x 16 x 4), per-group keys of one
    pair = R/8, R/4 or R/2 = 2, 4 or 8 features per group and the latent the rest: (r,
    rope_dim) = (28, 2), (24, 4), (16, 8), each (r + 2 rope_dim) x 4 = 128 bytes. The
    reference, written here: each split built by with_kv_latent and scored by the layer's
    output error on the held-out 2 of 8 sequences. The budget keeps the best, which is the
    one built to win: the narrowest key where K lives in one pair, the widest where every
    pair turns."""
    source, x = budget_layer_and_inputs(positions_matter, seed)
    errors = {
        (r, d): held_out_error(source, with_kv_latent(source, r, rope_dim=d), x[6:])
        for r, d in ((28, 2), (24, 4), (16, 8))
    }  # fmt: skip
    best = min(errors, key=errors.get)
    assert best == ((16, 8) if positions_matter else (28, 2))
    model = OneLayer(copy.deepcopy(source))
    (row,) = convert_attention(model, cache_budget=128, factorisation="svd", balance_kv=False,
                               rotary_key="per_group", calibration=x)  # fmt: skip
    assert (row["latent"]["kv_latent"], row["latent"]["rope_dim"]) == best
    scores = {(c["kv_latent"], c["rope_dim"]): c["score"] for c in row["candidates"]}
    assert scores == pytest.approx(errors, rel=1e-9)
    assert row["budget_bytes"] == 128 and row["bytes_after"] == (best[0] + 2 * best[1]) * 4 == 128
    with torch.no_grad():
        torch.testing.assert_close(model.attn(x, is_causal=True),
                                   with_kv_latent(source, *best[:1], rope_dim=best[1])(
                                       x, is_causal=True))  # fmt: skip


def test_a_budget_in_our_transformer_gives_each_kind_one_split_its_config_rebuilds():
    """Both self-attentions (2 groups of D = 8, all rotated; 128 bytes a token) at 1/4:
    32 bytes, 8 numbers: per-group keys of one pair (R/4 = 2; R/2 = 4 leaves no latent)
    beside a latent of 4, or a shared key of 4 beside 4; a kind's layers share the split,
    which the rewritten config rebuilds."""
    model, args = rope_transformer()
    batch = torch.randint(4, 50, (8, 7)), torch.randint(4, 50, (8, 5))
    scope = ["encoder_self_attention", "decoder_self_attention"]
    report = convert_attention(model, cache_budget=0.25, calibration=batch, scope=scope)
    assert [row["bytes_after"] for row in report] == [32] * 4
    for first, second in (report[:2], report[2:]):
        assert {k: first["latent"][k] for k in ("kv_latent", "rotary_key", "rope_dim")} == {
            k: second["latent"][k] for k in ("kv_latent", "rotary_key", "rope_dim")
        }
    rebuilt = Transformer(**args, **{k: model.attention_config[k] for k in scope})
    rebuilt.double().eval().load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(*batch), model(*batch), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"cache_budget": 16}, ValueError, r"cache_budget=16 allows model.layers.0.self_attn.attn "
         r"16 bytes per token, too few for any split: its narrowest rotary keys take 16 bytes, "
         r"and a latent needs at least 4 more"),
        ({"cache_budget": 132}, ValueError, r"cache_budget=132 is more than the KV cache of "
         r"model.layers.0.self_attn.attn, 128 bytes per token: a budget cuts the cache"),
        *[({"cache_budget": b}, error, r"cache_budget must be a layer's KV cache bytes per token "
           r"\(a positive integer\) or a fraction of its cache \(a float in \(0, 1\]\), got "
           + re.escape(repr(b))) for b, error in (("1/4", TypeError), (True, TypeError),
                                                   (0, ValueError), (1.5, ValueError),
                                                   (128.0, ValueError))],
        ({"cache_budget": 64, "kv_latent": 8}, ValueError, r"set exactly one of kv_heads, "
         r"kv_latent and cache_budget, got kv_heads=None, kv_latent=8, cache_budget=64"),
        ({"cache_budget": 64, "freqfold": 1}, ValueError, r"freqfold=1 folds one width of shared "
         r"key, and cache_budget=64 tries several: name rope_dim too, or leave freqfold unset"),
        ({"cache_budget": 64, "calibration": None}, ValueError, r"cache_budget=64 measures the "
         r"rotary keys' width against the latent's on calibration: pass calibration \(the "
         r"model's inputs\), or name rope_dim \(the latent then takes the rest\)"),
    ],
    ids=["too_small", "above_cache", "str", "bool", "zero", "fraction_above_1", "float_bytes",
         "with_kv_latent", "freqfold", "no_calibration"],
)  # fmt: skip
def test_a_bad_budget_is_refused_in_one_line_before_any_layer_changes(arguments, error, message):
    model, _, ids = _swapped_llama()  # 2 groups x 2 x 8 x 4 = 128 bytes a token and layer
    arguments = {"calibration": ids, **arguments}
    with pytest.raises(error, match=f"^{message}$"):
        convert_attention(model, **arguments)
    assert model.model.layers[0].self_attn.attn.head_tag == "gqa4kv2-rope"


def test_the_smallest_budget_and_a_named_rope_dim_give_the_bytes_counted_by_hand():
    """20 bytes = 5 numbers: the narrowest keys, per-group keys of 2 (2 groups: 4 numbers) or
    one shared key of 4, and a latent of 1, the one split that fits; with rope_dim named,
    nothing to measure: no calibration needed, the latent takes the rest (64 bytes = 16
    numbers: 16 - 2 x 2 = 12)."""
    model, swapped, ids = _swapped_llama()
    ids = torch.randint(2, 64, (4, 8), generator=torch.Generator().manual_seed(3))
    report = convert_attention(model, cache_budget=20, calibration=ids)
    for row in report:
        latent = row["latent"]
        width = {"per_group": 2, "shared": 4}[latent["rotary_key"]]
        assert (latent["kv_latent"], latent["rope_dim"], row["bytes_after"]) == (1, width, 20)
        assert {(c["kv_latent"], c["rotary_key"], c["rope_dim"]) for c in row["candidates"]} == {
            (1, "per_group", 2),
            (1, "shared", 4),
        }
    report = convert_attention(swapped, cache_budget=0.5, rope_dim=2, rotary_key="per_group")
    assert [(row["latent"]["kv_latent"], row["bytes_after"], row["budget_bytes"])
            for row in report] == [(12, 64, 64)] * 2  # fmt: skip
