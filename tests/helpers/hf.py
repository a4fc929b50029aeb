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


def perturbed(model):
    """``model`` with every parameter moved a little (in place): weights the model was not
    built with, so a reload that comes back with the built ones shows."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return model


def assert_saves_as_it_loads(swapped, swap, path, ids, mask, tolerance: float) -> None:
    """``swapped`` (a model after ``replace_hf_attention``), saved with ``save_pretrained``,
    loads through its stock class's ``from_pretrained`` (HF's eager attention) with every
    weight in place and the same logits; so does the project's reload path, the stock model
    swapped again (``swap``); and its ``state_dict`` is the stock model's, name for name."""
    swapped.save_pretrained(path)
    stock, info = type(swapped).from_pretrained(
        path, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    stock.eval()
    assert set(swapped.state_dict()) == set(stock.state_dict())
    assert max_token_difference(stock, swapped, ids, mask) < tolerance
    assert max_token_difference(swap(stock), swapped, ids, mask) < tolerance
