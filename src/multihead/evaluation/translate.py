"""Translating lists of sentences with a trained model (evaluate.py, translate.py)."""

from __future__ import annotations

from torch import nn

from multihead.data import Tokenizer, batches_by_length, collate
from multihead.model import decode


def translate(
    model: nn.Module,
    tokenizer: Tokenizer,
    sentences: list[str],
    *,
    beam_size: int,
    length_penalty: float,
    max_len_a: float,
    max_len_b: float,
    batch_size: int = 128,
) -> list[str]:
    """Translate ``sentences``; batches are formed by length and outputs kept in order.

    ``beam_size=1`` is greedy search. The model should be in eval mode. The search
    settings are those of :func:`multihead.model.decode`; those a checkpoint was trained
    with are :func:`multihead.checkpoints.search_settings`.
    """
    if beam_size < 1 or batch_size < 1:
        raise ValueError(f"beam_size and batch_size must be >= 1, got {beam_size}, {batch_size}")
    device = next(model.parameters()).device
    ids = tokenizer.encode_batch(sentences)
    out: list[str] = [""] * len(ids)
    for chunk in batches_by_length([len(x) for x in ids], batch_size):
        examples = [{"src_ids": ids[i], "tgt_ids": [], "src": "", "tgt": ""} for i in chunk]
        src = collate(
            examples, pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id
        )["src"].to(device)  # (B, S), ids + eos
        hyp_ids = decode(
            model,
            src,
            bos_id=tokenizer.bos_id,
            eos_id=tokenizer.eos_id,
            beam_size=beam_size,
            length_penalty=length_penalty,
            max_len_a=max_len_a,
            max_len_b=max_len_b,
        )
        for i, hyp in zip(chunk, tokenizer.decode_batch(hyp_ids), strict=True):
            out[i] = hyp
    return out
