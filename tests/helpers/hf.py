"""Batches and comparisons the Hugging Face tests share (torch only: no transformers here)."""

from __future__ import annotations

import torch


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 8: no padding, 3 left-padding tokens, 2 right-padding tokens."""
    ids = torch.randint(2, 64, (3, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, 6:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def max_token_difference(model, reference, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """The largest logit difference of two HF models over the positions ``mask`` keeps."""
    got, want = (m(ids, attention_mask=mask).logits for m in (model, reference))
    return (got - want)[mask.bool()].abs().max().item()
