"""Translating lists of sentences with a trained model (evaluate.py, translate.py)."""

from __future__ import annotations

from torch import nn

from multihead.data import Tokenizer, collate
from multihead.model import beam_search, greedy_decode


def translate(
    model: nn.Module,
    tokenizer: Tokenizer,
    sentences: list[str],
    *,
    beam_size: int = 5,
    length_penalty: float = 1.0,
    max_len_a: float = 1.2,
    max_len_b: int = 10,
    batch_size: int = 128,
) -> list[str]:
    """Translate ``sentences``; batches are formed by length and outputs kept in order.

    ``beam_size=1`` is greedy search. The model should be in eval mode.
    """
    if beam_size < 1 or batch_size < 1:
        raise ValueError(f"beam_size and batch_size must be >= 1, got {beam_size}, {batch_size}")
    device = next(model.parameters()).device
    ids = tokenizer.encode_batch(sentences)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths together
    out: list[str] = [""] * len(ids)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        examples = [
            {"src_ids": ids[i], "tgt_ids": [], "src": "", "tgt": "", "index": i} for i in chunk
        ]
        src = collate(
            examples, pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id
        )["src"].to(device)  # (B, S), ids + eos
        common = dict(
            bos_id=tokenizer.bos_id,
            eos_id=tokenizer.eos_id,
            max_len_a=max_len_a,
            max_len_b=max_len_b,
        )
        if beam_size == 1:
            hyp_ids = greedy_decode(model, src, **common)
        else:
            hyp_ids = beam_search(
                model, src, beam_size=beam_size, length_penalty=length_penalty, **common
            )
        for i, hyp in zip(chunk, tokenizer.decode_batch(hyp_ids), strict=True):
            out[i] = hyp
    return out
