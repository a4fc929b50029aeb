"""BLOOM (ALiBi) swapped onto the layer by ``replace_hf_attention``, against HF's eager BLOOM.

As in ``test_huggingface.py``: small random models (no Hub), logits compared at the
positions that are tokens. ``initializer_range=0.3``: at 0.2 this BLOOM's greedy generation
repeats one token, which would not show a wrong cache. 12 heads: ALiBi's slopes for a head
count that is not a power of two.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is the [hf] extra")

from transformers import AutoModelForCausalLM, BloomConfig  # noqa: E402

from multihead.attention.alibi import ALiBi  # noqa: E402
from multihead.integrations import huggingface as hf  # noqa: E402

from helpers.hf import (  # noqa: E402
    assert_saves_as_it_loads,
    max_token_difference,
    padded_batch,
    perturbed,
)

TOLERANCE = 1e-5


def eager_bloom(**overrides):
    torch.manual_seed(0)
    config = BloomConfig(
        vocab_size=64, hidden_size=48, n_layer=2, n_head=12, pad_token_id=0, bos_token_id=1,
        eos_token_id=None, initializer_range=0.3, **overrides,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_swapped_bloom_logits_match_eager_with_and_without_padding(backend, training) -> None:
    eager = eager_bloom().train(training)
    ours = hf.replace_hf_attention(copy.deepcopy(eager), backend=backend)
    assert isinstance(ours.transformer.h[0].self_attention, hf.BloomAttentionAdapter)
    ids, mask = padded_batch()
    assert max_token_difference(ours, eager, ids, mask) < TOLERANCE
    assert max_token_difference(ours, eager, ids, torch.ones_like(mask)) < TOLERANCE


def test_the_logits_test_tells_a_swap_without_the_bias(monkeypatch) -> None:
    eager = eager_bloom().eval()
    ours = hf.replace_hf_attention(copy.deepcopy(eager))
    monkeypatch.setattr(ALiBi, "score_bias", lambda self, q, k: torch.zeros(()))
    assert max_token_difference(ours, eager, *padded_batch()) > 1e-3


def test_flex_takes_the_bias_as_a_score_mod() -> None:
    eager = eager_bloom().eval()
    ours = hf.replace_hf_attention(copy.deepcopy(eager), backend="flex")
    with torch.no_grad():  # flex has no backward on the CPU
        assert max_token_difference(ours, eager, *padded_batch()) < TOLERANCE


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_swapped_bloom_generates_as_eager(cache: str) -> None:
    eager = eager_bloom().eval()
    ours = hf.replace_hf_attention(copy.deepcopy(eager))
    ids, mask = padded_batch()
    ids, mask = ids[:2], mask[:2]  # a full prompt and a left-padded one
    for rows in (slice(None), slice(0, 1)):
        args = dict(max_new_tokens=10, do_sample=False, cache_implementation=cache)
        want = eager.generate(ids[rows], attention_mask=mask[rows], **args)
        assert all(len(set(row[8:].tolist())) >= 3 for row in want)  # the test can tell
        assert torch.equal(ours.generate(ids[rows], attention_mask=mask[rows], **args), want)


def test_blooms_sliced_output_projection_is_refused() -> None:
    model = eager_bloom(pretraining_tp=2, slow_but_exact=True)
    with pytest.raises(ValueError, match=r"'transformer.h.0.self_attention': slow_but_exact"):
        hf.replace_hf_attention(model)


def test_a_swapped_bloom_saves_in_hf_layout_and_reloads_through_stock_from_pretrained(tmp_path):
    """BLOOM's ``query_key_value`` holds each head's q, k, v rows together; the layer stacks
    them: saved back in HF's order, the stock model has the swapped model's logits."""
    ours = perturbed(hf.replace_hf_attention(copy.deepcopy(eager_bloom().eval())))
    assert_saves_as_it_loads(
        ours, hf.replace_hf_attention, tmp_path, *padded_batch(), tolerance=TOLERANCE
    )
