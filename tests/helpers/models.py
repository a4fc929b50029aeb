"""Tiny models and inputs shared by the tests (CPU; torch and the core alone).

:func:`tiny_model` (d_model 32, 2 + 2 layers) is the model tests' model; :func:`analysis_model`
(d_model 16, GQA and MQA sublayers) is the analysis tests', with :data:`SENTENCES`.
"""

from __future__ import annotations

from typing import Any

import torch

from multihead.model import Transformer

PAD, BOS, EOS = 0, 1, 2
VOCAB = 40

# The head designs beyond MHA/GQA/MQA, as MultiHeadAttention keyword arguments: sparse heads
# (MoH) and the mixings, alone and with grouped K/V heads.
HEAD_DESIGNS = {
    "moh-k2": {"design": "moh", "top_k_heads": 2},
    "moh-k1s1": {"design": "moh", "top_k_heads": 1, "num_shared_heads": 1},
    "moh-k2s1-gqa": {"design": "moh", "top_k_heads": 2, "num_shared_heads": 1, "num_kv_heads": 2},
    "moh-k1s2-mqa": {"design": "moh", "top_k_heads": 1, "num_shared_heads": 2, "num_kv_heads": 1},
    "talking_heads": {"design": "talking_heads", "backend": "math"},
    "talking_heads-gqa": {"design": "talking_heads", "backend": "math", "num_kv_heads": 2},
    "group_mlp": {"design": "group_mlp"},
    "group_mlp4-mqa": {"design": "group_mlp", "mixing_groups": 4, "num_kv_heads": 1},
    "head_attention": {"design": "head_attention"},
    "head_attention-gqa": {"design": "head_attention", "num_kv_heads": 2},
}


def tiny_model(seed: int = 0, **overrides: Any) -> Transformer:
    """A tiny eval-mode Transformer without dropout, so outputs are deterministic."""
    torch.manual_seed(seed)
    kwargs: dict[str, Any] = dict(
        src_vocab_size=VOCAB,
        tgt_vocab_size=VOCAB,
        d_model=32,
        ffn_dim=64,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dropout=0.0,
        max_positions=64,
        pad_id=PAD,
        attention={"num_heads": 4},
    )
    kwargs.update(overrides)
    return Transformer(**kwargs).eval()


def decoding_model(seed: int = 1, **overrides: Any) -> Transformer:
    """A random model whose outputs vary and end at varied lengths.

    With tied embeddings a random post-LN decoder mostly repeats its input token, so the
    output projection is untied and sharpened, and eos is made likelier.
    """
    model = tiny_model(seed, share_embeddings=False, tie_output=False, **overrides)
    with torch.no_grad():
        model.output_projection.weight.mul_(3.0)
        model.output_projection.weight[EOS].mul_(2.0)
    return model


def random_src(batch: int, max_len: int, seed: int = 0, min_len: int = 1) -> torch.Tensor:
    """``(batch, max_len)`` ids in ``[3, VOCAB)`` right-padded to varied lengths."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, VOCAB, (batch, max_len), generator=g)
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=g)
    lengths[0] = max_len  # at least one row without padding
    src[torch.arange(max_len)[None, :] >= lengths[:, None]] = PAD
    return src


SENTENCES = [
    ("A dog runs in the park.", "Ein Hund rennt im Park."),
    ("Two men are talking.", "Zwei Männer unterhalten sich."),
    ("A girl reads a book.", "Ein Mädchen liest ein Buch."),
]


def analysis_model(
    vocab_size: int,
    backend: str = "sdpa",
    layers: int = 2,
    design: str | None = None,
    kv_latent_dim: int | None = None,
) -> Transformer:
    """A tiny eval-mode Transformer for the analysis tests: 4 query heads, 2 K/V heads in the
    decoder's self-attention and 1 in cross-attention, and ``design`` (without options) in
    every sublayer; with ``kv_latent_dim``, latent attention of that width in every sublayer
    instead."""
    torch.manual_seed(0)
    if kv_latent_dim is None:
        attention = {"num_heads": 4, "backend": backend, "design": design}
        per_sublayer = {
            "decoder_self_attention": {"num_kv_heads": 2},
            "cross_attention": {"num_kv_heads": 1},
        }
    else:
        latent = {"kv_latent_dim": kv_latent_dim}
        attention = {"num_heads": 4, "backend": backend, "design": "mla", "design_options": latent}
        per_sublayer = {}
    return Transformer(
        src_vocab_size=vocab_size,
        tgt_vocab_size=vocab_size,
        d_model=16,
        ffn_dim=32,
        num_encoder_layers=layers,
        num_decoder_layers=layers,
        dropout=0.1,
        max_positions=1024,
        attention=attention,
        **per_sublayer,
    ).eval()
