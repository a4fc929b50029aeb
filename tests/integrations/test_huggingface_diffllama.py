"""HF's DiffLlama swapped onto the layer's differential design, against its own eager forward.

As ``test_huggingface.py``: a small config with random weights (no Hub), far from uniform
logits (``initializer_range=0.2``), logits compared at the token positions (a padding query
has no key: eager averages every value there, the layer gives zeros).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is the [hf] extra")

from transformers import AutoModelForCausalLM, DiffLlamaConfig  # noqa: E402

from multihead.attention.differential import lambda_init_at  # noqa: E402
from multihead.integrations import huggingface as hf  # noqa: E402

from helpers.hf import assert_saves_as_it_loads, max_token_difference, perturbed  # noqa: E402

TOLERANCE = 1e-5


def eager_diffllama():
    torch.manual_seed(0)
    config = DiffLlamaConfig(
        vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=None, initializer_range=0.2,
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def swapped(model):
    return hf.replace_hf_attention(copy.deepcopy(model))


def through_the_interface(model):
    """DiffLlama's own module on the layer's kernel (``attn_implementation="multihead"``)."""
    hf.register()
    ours = copy.deepcopy(model)
    ours.set_attn_implementation("multihead")
    return ours


def left_padded_batch():
    """Two prompts of 8 tokens, the second with 3 left-padding tokens."""
    ids = torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    return ids.masked_fill(mask == 0, 0), mask


def test_the_swap_holds_differential_layers_with_each_layers_lambda() -> None:
    model = swapped(eager_diffllama())
    for i, layer in enumerate(model.model.layers):
        design = layer.self_attn.attn.design
        assert design.name == "diff"
        assert design.lambda_init == pytest.approx(lambda_init_at(i))
        eager_lambda = eager_diffllama().model.layers[i].self_attn.lambda_q1
        torch.testing.assert_close(design.lambda_q1, eager_lambda, rtol=0, atol=0)


@pytest.mark.parametrize("path", [swapped, through_the_interface], ids=["swap", "interface"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_logits_match_eager_with_left_padding(path, training: bool) -> None:
    eager = eager_diffllama()
    ours = path(eager)
    eager.train(training)
    ours.train(training)
    ids, mask = left_padded_batch()
    assert max_token_difference(ours, eager, ids, mask) < TOLERANCE
    assert max_token_difference(ours, eager, ids, torch.ones_like(mask)) < TOLERANCE


def test_gradients_reach_the_lambda_vectors_as_eager() -> None:
    eager = eager_diffllama().train()
    ours = swapped(eager).train()
    ids, _ = left_padded_batch()  # no padding: a padding position's logits differ (above)
    for model in (eager, ours):
        model(ids, labels=ids).loss.backward()
    for theirs, mine in zip(eager.model.layers, ours.model.layers, strict=True):
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            want = getattr(theirs.self_attn, name).grad
            got = getattr(mine.self_attn.attn.design, name).grad
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_greedy_generation_equals_eager_with_the_dynamic_cache() -> None:
    eager = eager_diffllama().eval()
    ours = swapped(eager)
    ids, mask = left_padded_batch()
    for rows in (slice(None), slice(1, 2)):
        args = dict(attention_mask=mask[rows], max_new_tokens=10, do_sample=False)
        want = eager.generate(ids[rows], cache_implementation="dynamic", **args)
        assert all(len(set(row[8:].tolist())) >= 3 for row in want)  # the test can tell
        assert torch.equal(ours.generate(ids[rows], cache_implementation="dynamic", **args), want)


def test_a_swapped_diffllama_saves_in_hf_names_and_reloads_through_stock_from_pretrained(
    tmp_path,
) -> None:
    """The lambda vectors, held by the layer's differential design, saved as HF's."""
    ours = perturbed(swapped(eager_diffllama().eval()))
    ids, mask = left_padded_batch()
    assert_saves_as_it_loads(ours, hf.replace_hf_attention, tmp_path, ids, mask, TOLERANCE)
