"""Export a trained checkpoint to a CTranslate2 model directory.

The layout follows CTranslate2's own converters (``converters/fairseq.py``,
``converters/opennmt_py.py``): a :class:`ctranslate2.specs.TransformerSpec` is built from the
model's settings and filled with its weights through the public spec API, then saved. What
maps onto what:

- post-LN / pre-LN: ``pre_norm``; pre-LN's final encoder/decoder LayerNorm is the spec's
  ``layer_norm``. Our LayerNorm epsilon goes into the config (CTranslate2's default differs).
- attention: our stacked ``in_proj`` rows are ``[Q; K; V]`` with ``G * D`` rows each for K
  and V, which is CTranslate2's fused self-attention layout for MHA, GQA and MQA alike; for
  cross-attention ``[Q]`` and ``[K; V]`` are its two input projections. ``num_heads_kv`` is
  written per attention sublayer, so encoder self-, decoder self- and cross-attention may
  each have their own K/V head count. CTranslate2 has no latent attention: an MLA layer is
  written as the MHA layer it equals (K/V weights ``W_UK W_DKV``, ``W_UV W_DKV``), which
  CTranslate2 then runs with an MHA-sized cache.
- positions: our table (sinusoidal, interleaved sin/cos, or learned) is written as the
  spec's ``encodings`` so CTranslate2 does not use its own (concatenated) sinusoids.
- embeddings: ``sqrt(E)`` scaling as ours; shared matrices are stored once (the spec
  aliases equal variables); the output projection has no bias.
- vocabulary: our byte-level BPE token strings in id order, one joint list
  (``shared_vocabulary.json``); ``<bos>`` starts the decoder, ``<eos>`` is added to the
  source (our ``collate`` does the same) and ends the target. A ``data.lowercase``
  tokenizer keeps its normalizer in the exported ``tokenizer.json``, so whatever encodes
  with that file lowercases its input as ours does.

What CTranslate2 cannot express raises :class:`ExportError` naming the setting: a head count
(query or K/V) that differs between the layers of one kind, decoder self- and
cross-attention with different query head counts, an attention module that is not ours, a
head design other than latent attention (sparse heads, mixings), a normalised latent.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer
from torch import nn

from multihead.attention import MultiHeadAttention
from multihead.attention.checks import check_bool
from multihead.attention.convert import expand_latent
from multihead.checkpoints.io import load_trained_model, search_settings
from multihead.data import Tokenizer
from multihead.data.tokenizer import BOS, EOS, UNK
from multihead.model import Transformer
from multihead.model.transformer import DecoderLayer, FeedForward

FORMATS = ("ctranslate2",)
_ACTIVATIONS = ("relu", "gelu")
# Besides CTranslate2's own files, the export holds what translating like ours needs.
TOKENIZER_FILE = "tokenizer.json"
SETTINGS_FILE = "multihead.json"

README = """\
# A CTranslate2 model exported from a multihead checkpoint

Exported from `{ckpt}` with CTranslate2 {ct2_version}. Translate with it:

```python
import ctranslate2, tokenizers
tok, model = tokenizers.Tokenizer.from_file("{out}/tokenizer.json"), ctranslate2.Translator("{out}")
tokens = tok.encode("A dog runs on the beach.", add_special_tokens=False).tokens
out = model.translate_batch(
    [tokens], beam_size=5, min_decoding_length=0, max_input_length=0, max_decoding_length={limit}
)
print(tok.decoder.decode(out[0].hypotheses[0]))
```

`max_decoding_length` stays below the {max_positions} positions the model has.
`Translator(..., compute_type="int8")` quantizes the weights when loading.
`python scripts/translate.py engine=ctranslate2 model_dir={out}` translates exactly as
`scripts/translate.py ckpt=...` does: its per-sentence length limit
(`floor(max_len_a * src_len + max_len_b)`), eos allowed as the first token, and the length
penalty counting eos. `multihead.json` holds the settings it reads (max_positions, languages).
"""


class ExportError(ValueError):
    """A checkpoint setting that the export format cannot express, or a missing package."""


def import_ctranslate2() -> Any:
    """``ctranslate2``, or an :class:`ExportError` saying how to install it."""
    try:
        import ctranslate2
    except ImportError:
        raise ExportError(
            "ctranslate2 is not installed; expected it for format=ctranslate2 "
            '(pip install -e ".[deploy]")'
        ) from None
    return ctranslate2


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy().copy()


def _same_across_layers(kind: str, layers: list[MultiHeadAttention]) -> tuple[int, int]:
    """The ``(num_heads, num_kv_heads)`` all ``layers`` share, else an ExportError."""
    for attn in layers:
        if not isinstance(attn, MultiHeadAttention):
            raise ExportError(
                f"{kind} is a {type(attn).__name__}; expected multihead.MultiHeadAttention "
                "(an unknown head design cannot be exported)"
            )
        if _is_latent(attn):
            try:
                expand_latent(attn)  # refuses what no MHA layer computes, naming it
            except ValueError as err:
                raise ExportError(
                    f"{kind} {err}; CTranslate2 runs MLA as its MHA equivalent (expand_latent)"
                ) from None
        elif attn.design is not None:
            raise ExportError(
                f"{kind} has head design {attn.head_tag!r}; CTranslate2 runs plain "
                "MHA/GQA/MQA attention (and MLA, as its MHA equivalent)"
            )
    heads = sorted({(a.num_heads, a.num_kv_heads) for a in layers})  # MLA: G = H
    if len(heads) > 1:
        raise ExportError(
            f"{kind} has (heads, K/V heads) {heads} differing between layers; expected one "
            "setting per sublayer kind, as CTranslate2 models have"
        )
    return heads[0]


def check_exportable(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{kind: (num_heads, num_kv_heads)}`` if CTranslate2 can express ``model``.

    Raises:
        ExportError: naming the first setting it cannot express.
    """
    if not isinstance(model, Transformer):
        raise ExportError(f"expected a multihead.model.Transformer, got {type(model).__name__}")
    parts = {getattr(a, "positions", None) for *_, a in model.attention_sublayers()}
    biases = sorted({type(p).__name__ for p in parts if getattr(p, "seam", None) == "score_bias"})
    if biases:  # a positional part that adds a bias to the scores
        raise ExportError(
            f"a score bias in the attention ({', '.join(biases)}: positional='alibi') cannot be "
            "exported: CTranslate2 (4.8) has ALiBi in its decoder spec only, not in "
            "TransformerEncoderSpec; expected sinusoidal or learned positions"
        )
    if model.encoder_embedding.positional is None:
        raise ExportError(
            "positional='rope' cannot be exported yet; expected sinusoidal or learned positions "
            "(the export writes a position table)"
        )
    sublayers: dict[str, list] = {}  # kind -> its layers, from the model's one enumeration
    for kind, _, _, attn in model.attention_sublayers():
        sublayers.setdefault(kind, []).append(attn)
    heads = {kind: _same_across_layers(kind, layers) for kind, layers in sublayers.items()}
    decoder_heads, cross_heads = heads["decoder_self_attention"][0], heads["cross_attention"][0]
    if decoder_heads != cross_heads:
        raise ExportError(
            f"decoder_self_attention has {decoder_heads} query heads but cross_attention "
            f"{cross_heads}; CTranslate2 expects one query head count per decoder"
        )
    activations = {m.activation.__name__ for m in model.modules() if isinstance(m, FeedForward)}
    if len(activations) != 1 or not activations <= set(_ACTIVATIONS):
        raise ExportError(
            f"activation {sorted(activations)} cannot be exported; expected one of "
            f"{list(_ACTIVATIONS)}"
        )
    eps = {m.eps for m in model.modules() if isinstance(m, nn.LayerNorm)}
    if len(eps) != 1:
        raise ExportError(f"LayerNorm epsilons {sorted(eps)} differ; expected one value")
    return heads


def _set_linear(spec: Any, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    spec.weight = _numpy(weight)
    if bias is not None:
        spec.bias = _numpy(bias)


def _set_layer_norm(spec: Any, norm: nn.LayerNorm) -> None:
    spec.gamma = _numpy(norm.weight)
    spec.beta = _numpy(norm.bias)


def _is_latent(attn: MultiHeadAttention) -> bool:
    """Whether ``attn`` is an MLA layer (a design that converts to its MHA equivalent)."""
    return attn.design is not None and "expand_latent" in attn.design.conversions


def _set_attention(spec: Any, attn: MultiHeadAttention, *, cross: bool) -> None:
    """Our stacked ``[Q; K; V]`` projection into CTranslate2's one or two input linears."""
    if _is_latent(attn):
        attn = expand_latent(attn)  # the MHA layer it equals
    (q, k, v), (b_q, b_k, b_v) = attn.in_proj.blocks(), attn.in_proj.blocks("bias")
    bias = b_q is not None
    if cross:
        _set_linear(spec.linear[0], q, b_q)  # Q
        _set_linear(spec.linear[1], torch.cat([k, v]), torch.cat([b_k, b_v]) if bias else None)
    else:  # [Q; K; V], CTranslate2's fused order
        _set_linear(
            spec.linear[0], torch.cat([q, k, v]), torch.cat([b_q, b_k, b_v]) if bias else None
        )
    _set_linear(spec.linear[-1], attn.out_proj.weight, attn.out_proj.bias)
    # Read per attention scope by CTranslate2 (attention_layer.cc), so each sublayer kind
    # keeps its own K/V heads (the decoder spec gives cross-attention the self-attention's).
    spec.num_heads_kv = np.int32(attn.num_kv_heads)


def build_spec(model: Transformer, tokenizer: Tokenizer) -> Any:
    """A filled, validated ``ctranslate2.specs.TransformerSpec`` for ``model``.

    Raises:
        ExportError: ``model`` has a setting CTranslate2 cannot express, or ctranslate2 is
            not installed.
    """
    ctranslate2 = import_ctranslate2()
    specs = ctranslate2.specs
    heads = check_exportable(model)
    activation = model.encoder_layers[0].ffn.activation.__name__
    act = {"relu": specs.Activation.RELU, "gelu": specs.Activation.GELU}[activation]
    common = dict(pre_norm=model.norm_first, activation=act)
    # An explicit num_heads_kv (even = num_heads) declares the attribute on every attention
    # spec, so _set_attention can write each sublayer's own count.
    encoder, decoder = (
        make(len(layers), heads[kind][0], num_heads_kv=heads[kind][1], **common)
        for make, layers, kind in (
            (specs.TransformerEncoderSpec, model.encoder_layers, "encoder_self_attention"),
            (specs.TransformerDecoderSpec, model.decoder_layers, "decoder_self_attention"),
        )
    )

    encoder.embeddings[0].weight = _numpy(model.encoder_embedding.token.weight)
    decoder.embeddings.weight = _numpy(model.decoder_embedding.token.weight)
    for spec, embedding in ((encoder, model.encoder_embedding), (decoder, model.decoder_embedding)):
        positional = embedding.positional  # sinusoidal or learned: (P, E), position 0 first
        spec.position_encodings.encodings = _numpy(positional(positional.max_positions))
        spec.scale_embeddings = True  # multiplied by sqrt(E), as TransformerEmbedding
    decoder.projection.weight = _numpy(model.output_projection.weight)  # no bias

    for spec, layer in [
        *zip(encoder.layer, model.encoder_layers, strict=True),
        *zip(decoder.layer, model.decoder_layers, strict=True),
    ]:
        _set_attention(spec.self_attention, layer.self_attn, cross=False)
        _set_layer_norm(spec.self_attention.layer_norm, layer.self_attn_norm)
        if isinstance(layer, DecoderLayer):
            _set_attention(spec.attention, layer.cross_attn, cross=True)
            _set_layer_norm(spec.attention.layer_norm, layer.cross_attn_norm)
        _set_layer_norm(spec.ffn.layer_norm, layer.ffn_norm)
        _set_linear(spec.ffn.linear_0, layer.ffn.linear1.weight, layer.ffn.linear1.bias)
        _set_linear(spec.ffn.linear_1, layer.ffn.linear2.weight, layer.ffn.linear2.bias)
    if model.norm_first:
        _set_layer_norm(encoder.layer_norm, model.encoder_norm)
        _set_layer_norm(decoder.layer_norm, model.decoder_norm)

    spec = specs.TransformerSpec(encoder, decoder)
    eps = next(m.eps for m in model.modules() if isinstance(m, nn.LayerNorm))
    spec.config.layer_norm_epsilon = float(eps)
    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = UNK, BOS, EOS
    spec.config.decoder_start_token = BOS
    spec.config.add_source_eos = True  # our sources end with eos (data.collate)
    vocabulary = vocabulary_tokens(tokenizer)
    spec.register_source_vocabulary(vocabulary)
    spec.register_target_vocabulary(vocabulary)
    spec.validate()
    return spec


def vocabulary_tokens(tokenizer: Tokenizer) -> list[str]:
    """The token string of every id, in id order; CTranslate2 maps tokens by these strings.

    Raises:
        ExportError: two ids share a string (CTranslate2 would map both to one id).
    """
    # Our wrapper hides the Rust tokenizer; its JSON form gives the public token API.
    hf = HFTokenizer.from_str(tokenizer.to_str())
    tokens = [hf.id_to_token(i) for i in range(tokenizer.vocab_size)]
    if len(set(tokens)) != len(tokens):
        seen: set[str] = set()
        twice = next(t for t in tokens if t in seen or seen.add(t))
        raise ExportError(f"token {twice!r} appears twice in the vocabulary; expected unique")
    return tokens


def export_ctranslate2(*, ckpt: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Write the CTranslate2 model of checkpoint ``ckpt`` into directory ``out``.

    The files (``model.bin``, ``config.json``, ``shared_vocabulary.json``, our
    ``tokenizer.json`` and ``multihead.json``, a README) are written into a temporary
    directory beside ``out``, which is renamed to ``out`` only when complete; on any failure
    an existing ``out`` is left as it was.

    Args:
        ckpt: a checkpoint written by ``scripts/train.py`` (or averaged / converted).
        out: the directory to create.
        overwrite: replace an existing non-empty ``out``.

    Returns:
        ``out``.

    Raises:
        FileNotFoundError, ValueError: ``ckpt`` is missing or not a checkpoint.
        FileExistsError: ``out`` exists, is not empty and ``overwrite`` is false.
        ExportError: the model cannot be expressed, or ctranslate2 is missing.
    """
    check_bool("overwrite", overwrite)  # "no" would replace out
    ctranslate2 = import_ctranslate2()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"out={out} exists and is not a directory; expected a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"out={out} exists and is not empty; pass overwrite=true to replace it"
        )
    trained = load_trained_model(ckpt)
    spec = build_spec(trained.model, trained.tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        spec.optimize()  # aliases shared matrices; weights stay float32
        spec.save(str(tmp))
        trained.tokenizer.save(tmp / TOKENIZER_FILE)
        data = trained.config.get("data", {})
        settings = {
            "max_positions": trained.model.max_positions,
            "src_lang": data.get("src_lang"),
            "tgt_lang": data.get("tgt_lang"),
            "checkpoint": str(ckpt),
            "head_config": trained.model.head_config,
            # The search settings it was trained with, as search_settings reads them.
            "module": search_settings(trained.config),
        }
        (tmp / SETTINGS_FILE).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
        (tmp / "README.md").write_text(
            README.format(
                out=out,
                ckpt=ckpt,
                ct2_version=ctranslate2.__version__,
                max_positions=trained.model.max_positions,
                limit=trained.model.max_positions - 1,
            ),
            encoding="utf-8",
        )
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a model directory is not
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
