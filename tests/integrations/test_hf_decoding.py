"""Decoding an HF model: AppendCache (appends in place) and prepare_for_decoding (packed
weights). The references are HF's own DynamicCache and the unprepared model."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is the [hf] extra")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig  # noqa: E402
from transformers.cache_utils import DynamicSlidingWindowLayer  # noqa: E402

from multihead.integrations import huggingface as hf  # noqa: E402
from multihead.integrations.hf_decoding import AppendLayer  # noqa: E402
from multihead.packed import PackedLinear  # noqa: E402

COMMON = dict(vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=None)
COMMON |= dict(initializer_range=0.2, hidden_size=32, intermediate_size=64, num_hidden_layers=2)


def _llama(**config) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **COMMON, **config)
    return LlamaForCausalLM(config).eval()


def _left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(2, 64, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("implementation", ["sdpa", "multihead", "swap"])
@pytest.mark.parametrize("beams", [1, 3])
def test_append_cache_generates_the_tokens_of_dynamic_cache(implementation, beams):
    """Greedy and beam search (which reorders the cache's rows) with left padding, on HF's
    own sdpa, our kernels and the swapped layer: the same tokens as HF's default cache."""
    hf.register()
    model = _llama()
    if implementation == "swap":
        hf.replace_hf_attention(model)
    else:
        model.set_attn_implementation(implementation)
    ids, mask = _left_padded()
    settings = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, num_beams=beams)
    want = model.generate(ids, cache=DynamicCache(config=model.config), **settings)
    cache = hf.AppendCache(config=model.config)
    got = model.generate(ids, cache=cache, **settings)
    assert torch.equal(got, want)
    assert all(isinstance(layer, AppendLayer) for layer in cache.layers)


def test_append_cache_writes_in_place_until_full_then_grows_keeping_the_past():
    cache = hf.AppendCache()
    k = torch.randn(2, 1, 5, 4)
    keys, values = cache.update(k, k + 1, layer_idx=0)
    layer = cache.layers[0]
    assert torch.equal(keys, k) and torch.equal(values, k + 1)
    capacity, start = layer._key_buffer.shape[-2], keys.data_ptr()
    assert capacity > 5
    for step in range(capacity - 5):  # up to the buffer's end: in place
        new = torch.full((2, 1, 1, 4), float(step))
        keys, _ = cache.update(new, new, layer_idx=0)
        assert keys.data_ptr() == start and keys.shape[-2] == 6 + step
        assert torch.equal(keys[..., :5, :], k) and torch.equal(keys[..., -1:, :], new)
    keys, _ = cache.update(new, new, layer_idx=0)  # one more: a new buffer, the past kept
    assert keys.data_ptr() != start and cache.get_seq_length(0) == capacity + 1
    assert torch.equal(keys[..., :5, :], k) and torch.equal(
        keys[..., -2:, :], new.expand(-1, -1, 2, -1)
    )
    # What it holds beyond the past: a quarter more, at least 256 positions.
    assert layer._key_buffer.shape[-2] == capacity + 1 + max(256, (capacity + 1) // 4)


def test_append_cache_holds_a_quarter_more_than_a_long_prompt():
    cache = hf.AppendCache()
    k = torch.randn(1, 1, 4000, 2)
    cache.update(k, k, layer_idx=0)
    assert cache.layers[0]._key_buffer.shape[-2] == 5000


def test_append_cache_keeps_hf_sliding_window_layers():
    config = MistralConfig(num_attention_heads=4, num_key_value_heads=1, sliding_window=3, **COMMON)
    cache = hf.AppendCache(config=config)
    assert all(isinstance(layer, DynamicSlidingWindowLayer) for layer in cache.layers)


def test_prepare_for_decoding_packs_every_linear_and_keeps_the_logits():
    hf.register()
    model = _llama()
    reference = copy.deepcopy(model)
    model.set_attn_implementation("multihead")
    keys = list(model.state_dict())
    model.train()
    assert hf.prepare_for_decoding(model) is model and not model.training
    packed = [n for n, m in model.named_modules() if isinstance(m, PackedLinear)]
    linears = [n for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear)]
    assert packed == linears and "lm_head" in packed and list(model.state_dict()) == keys
    ids, mask = _left_padded()
    with torch.no_grad():
        got, want = (m(ids, attention_mask=mask).logits for m in (model, reference))
    assert model.lm_head._packed is not None  # the oneDNN path ran
    assert (got - want)[mask.bool()].abs().max() < 1e-5


def test_prepare_for_decoding_refuses_a_model_without_linear_layers():
    with pytest.raises(ValueError, match="Embedding has no nn.Linear to pack"):
        hf.prepare_for_decoding(torch.nn.Embedding(4, 4))
