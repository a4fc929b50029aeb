"""Decoding an HF model: AppendCache (appends in place) and prepare_for_decoding (packed
weights). The references are HF's own DynamicCache and the unprepared model."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is the [hf] extra")

from transformers import (  # noqa: E402
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.cache_utils import DynamicSlidingWindowLayer  # noqa: E402

from multihead.integrations import huggingface as hf  # noqa: E402
from multihead.integrations.hf_decoding import AppendLayer  # noqa: E402
from multihead.packed import PackedLinear, can_pack  # noqa: E402

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


# ---------------------------------------------- a prepared model follows its weights
GQA = dict(num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "llama-mha": lambda: LlamaForCausalLM(LlamaConfig(num_attention_heads=4, **COMMON)),
    "llama-gqa": lambda: LlamaForCausalLM(LlamaConfig(**GQA, **COMMON)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**GQA, **COMMON)),  # Q/K/V biases
    "llama-tied": lambda: LlamaForCausalLM(LlamaConfig(**GQA, tie_word_embeddings=True, **COMMON)),
}


def _prepared_and_twin(family: str):
    """A model on ``"multihead"`` prepared for decoding, with its copies made (one decode),
    and an unprepared twin: the reference for every weight change below."""
    hf.register()
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    # Fresh tensors, version 0, as from_pretrained loads them.
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    model.set_attn_implementation("multihead")
    twin = copy.deepcopy(model)
    hf.prepare_for_decoding(model)
    with torch.no_grad():
        model(_left_padded()[0])
    assert model.lm_head._packed is not None
    return model, twin


def _new_weights(family: str) -> dict[str, torch.Tensor]:
    """Other weights for the same model: a build from another seed."""
    torch.manual_seed(1)
    return FAMILIES[family]().state_dict()


def _set_data(model, new):
    for name, p in model.named_parameters():
        p.data = new[name].clone()


def _copy_data_then_prepare_again(model, new):
    # .data has a version counter of its own: no check sees this edit; the documented call
    # after it makes the copies anew.
    for name, p in model.named_parameters():
        p.data.copy_(new[name])
    if any(isinstance(m, PackedLinear) for m in model.modules()):
        hf.prepare_for_decoding(model)


def _load_assigned(model, new):
    model.load_state_dict({k: v.clone() for k, v in new.items()}, assign=True)


CHANGES = {
    "p.data=": _set_data,
    "p.data.copy_": _copy_data_then_prepare_again,
    "load_state_dict(assign=True)": _load_assigned,
    "to(bf16).float()": lambda model, new: model.to(torch.bfloat16).float(),
}


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_prepared_model_computes_with_its_weights_after_they_change(family, change):
    """After each change applied to both, the prepared model's logits and greedy tokens are
    its unprepared twin's (before the fix: up to 10 off and other tokens, the old weights)."""
    model, twin = _prepared_and_twin(family)
    new = _new_weights(family)
    for m in (model, twin):
        CHANGES[change](m, new)
    ids, mask = _left_padded()
    with torch.no_grad():
        got, want = (m(ids, attention_mask=mask).logits for m in (model, twin))
    assert (got - want)[mask.bool()].abs().max() < 1e-5
    settings = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(ids, **settings), twin.generate(ids, **settings))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prepared_model_cast_to_bf16_decodes_as_the_unprepared_one(family):
    """``.to(bfloat16)`` after a decode: before the fix, oneDNN was handed the fp32 copy
    (RuntimeError: could not create a primitive descriptor for the inner product)."""
    model, twin = _prepared_and_twin(family)
    for m in (model, twin):
        m.to(torch.bfloat16)
    ids, mask = _left_padded()
    with torch.no_grad():
        got, want = (m(ids, attention_mask=mask).logits.float() for m in (model, twin))
    assert (got - want)[mask.bool()].abs().max() < 1e-5
    # oneDNN ran in bf16 where this CPU has it natively.
    assert (model.lm_head._packed is not None) == can_pack(model.lm_head.weight)
    settings = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(ids, **settings), twin.generate(ids, **settings))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prepared_model_honours_cpu_autocast(family):
    """Under ``autocast(bfloat16)`` the prepared linears compute as ``F.linear`` does there
    (before the fix: in fp32, 0.14 off the unprepared model under the same autocast)."""
    model, twin = _prepared_and_twin(family)
    ids, mask = _left_padded()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = (m(ids, attention_mask=mask).logits.float() for m in (model, twin))
    assert (got - want)[mask.bool()].abs().max() < 1e-5
