"""HF's DeepSeek-V2/V3 swapped onto the layer's MLA design, against their own eager forward.

As ``test_huggingface.py``: small configs with random weights (no Hub), far from uniform
logits, logits compared at the token positions (a padding query has no key: eager averages
every value there, the layer gives zeros). The attention's widths are the real models' (V3:
``E / H = 56`` with ``v_head_dim = 128``; V2-Lite: no low-rank query), with 4 heads; one
dense layer and one tiny MoE layer. Their weights are drawn with ``initializer_range=0.05``
(HF's default is 0.02; 0.15 for the tiny widths), narrower than ``test_huggingface.py``'s
0.2 for widths 8 times larger: at 0.2 the logits reach 16 and fp32 rounding alone moves
them by 2e-4 (the swap's own logits in fp32 against fp64), more than the 1e-5 compared here.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is the [hf] extra")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    DynamicCache,
    StaticCache,
)

from multihead.attention.latent import LatentKV  # noqa: E402
from multihead.integrations import huggingface as hf  # noqa: E402

from helpers.hf import (  # noqa: E402
    assert_saves_as_it_loads,
    max_token_difference,
    padded_batch,
    perturbed,
)

TOLERANCE = 1e-5
COMMON = dict(vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=None)
COMMON |= dict(num_hidden_layers=2, first_k_dense_replace=1)
MOE = dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16)
# DeepSeek-V3's attention widths (kv_lora_rank, q_lora_rank, head dims) and rope parameters
# (config.json of deepseek-ai/DeepSeek-V3), with 4 heads of its E / H = 7168 / 128 = 56.
V3_WIDTHS = dict(
    hidden_size=4 * 56, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, max_position_embeddings=163840, n_group=2, topk_group=1,
    initializer_range=0.05,
)  # fmt: skip
V3_YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0, mscale_all_dim=1.0,
    original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
)  # fmt: skip
# DeepSeek-V2-Lite's: no low-rank query, E / H = 2048 / 16 = 128 = v_head_dim.
V2_LITE_WIDTHS = dict(
    hidden_size=4 * 128, intermediate_size=64, num_attention_heads=4, kv_lora_rank=512,
    q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    max_position_embeddings=163840, initializer_range=0.05,
)  # fmt: skip
V2_LITE_YARN = V3_YARN | dict(mscale=0.707, mscale_all_dim=0.707)
TINY = dict(
    hidden_size=64, intermediate_size=64, num_attention_heads=4, kv_lora_rank=16,
    qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, max_position_embeddings=256,
    initializer_range=0.15,
)  # fmt: skip
# mscale != mscale_all_dim: YaRN's attention_factor (the magnitude of cos and sin) is not 1.
TINY_YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.8, mscale_all_dim=1.0,
    original_max_position_embeddings=64,
)  # fmt: skip
V3_TINY = dict(
    num_key_value_heads=4, q_lora_rank=24, rope_interleave=False, attention_bias=True, n_group=2,
    topk_group=1,
)  # fmt: skip
CONFIGS = {
    "v3": lambda: DeepseekV3Config(**V3_WIDTHS, rope_parameters=V3_YARN, **MOE, **COMMON),
    "v2-lite": lambda: DeepseekV2Config(
        **V2_LITE_WIDTHS, rope_parameters=V2_LITE_YARN, **MOE, **COMMON
    ),
    # Rotate-half pairs, biases, a YaRN attention_factor, a low-rank query on V2.
    "v3-halves-bias-yarn": lambda: DeepseekV3Config(
        **TINY, **V3_TINY, rope_parameters=TINY_YARN, **MOE, **COMMON
    ),
    "v2-lowrank-q-bias": lambda: DeepseekV2Config(
        **TINY, q_lora_rank=24, attention_bias=True, **MOE, **COMMON
    ),
}


def eager_model(family: str, **overrides):
    torch.manual_seed(0)
    config = CONFIGS[family]()
    for name, value in overrides.items():
        setattr(config, name, value)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def swapped(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the copied weights' warning: no optimizer here
        return hf.replace_hf_attention(copy.deepcopy(model))


def generate(model, ids, mask, cache: str):
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=20, do_sample=False, cache_implementation=cache
    )


@pytest.mark.parametrize("family", CONFIGS)
def test_the_swap_holds_mla_layers_of_the_models_widths(family: str) -> None:
    model = swapped(eager_model(family))
    config = model.config
    H, dv = config.num_attention_heads, config.v_head_dim
    for layer in model.model.layers:
        attn = layer.self_attn.attn
        options = attn.head_config
        assert isinstance(attn.design, LatentKV) and options["kv_latent_norm"]
        assert options["kv_latent_dim"] == config.kv_lora_rank
        assert options["rotary_dim"] == config.qk_rope_head_dim
        assert attn.design.qk_head_dim == config.qk_nope_head_dim
        assert attn.design.v_head_dim == dv
        assert attn.design.q_latent_dim == config.q_lora_rank
        assert attn.out_proj.weight.shape == (config.hidden_size, H * dv)


@pytest.mark.parametrize("family", CONFIGS)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_logits_match_eager_with_left_and_right_padding(family: str, training: bool) -> None:
    eager = eager_model(family)
    ours = swapped(eager)
    eager.train(training)
    ours.train(training)
    assert max_token_difference(ours, eager, *padded_batch()) < TOLERANCE
    ids = padded_batch()[0][:1]  # a full prompt, no mask
    assert (ours(ids).logits - eager(ids).logits).abs().max() < TOLERANCE


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", CONFIGS)
def test_greedy_generation_equals_eager_with_hf_cache(family: str, cache: str) -> None:
    eager = eager_model(family).eval()
    ours = swapped(eager)
    ids, mask = padded_batch()
    ids, mask = ids[:2], mask[:2]  # the second row left-padded
    want = generate(eager, ids, mask, cache)
    assert all(len(set(row[8:].tolist())) >= 3 for row in want)  # the test can tell
    assert torch.equal(generate(ours, ids, mask, cache), want)


def test_decoding_attends_over_the_cached_latent_without_expanding_it(monkeypatch) -> None:
    """Eval-mode decoding takes the absorbed path: no K or V is expanded from the latent."""
    eager = eager_model("v3").eval()
    ours = swapped(eager)
    expanded = []
    expand = LatentKV.expand
    monkeypatch.setattr(LatentKV, "expand", lambda *a: expanded.append(1) or expand(*a))
    ids, mask = padded_batch()
    for cache in ("dynamic", "static"):
        want = generate(eager, ids[:2], mask[:2], cache)
        assert torch.equal(generate(ours, ids[:2], mask[:2], cache), want)
        assert not expanded


def test_a_reset_cache_starts_a_new_search_with_the_new_weights() -> None:
    """A StaticCache reused after a reset and a weight change (as between two searches of a
    training run) decodes with the new weights."""
    eager = eager_model("v2-lowrank-q-bias").eval()
    ours = swapped(eager)
    ids = padded_batch()[0][:1]
    cache = StaticCache(config=ours.config, max_cache_len=16)
    with torch.no_grad():
        ours(ids, cache=cache)
        cache.reset()
        for theirs, layer in zip(eager.model.layers, ours.model.layers, strict=True):
            theirs.self_attn.kv_b_proj.weight.mul_(1.5)  # W_UK and W_UV, in both models
            layer.self_attn.attn.design.up.weight.mul_(1.5)
        assert (ours(ids, cache=cache).logits - eager(ids).logits).abs().max() < TOLERANCE


@pytest.mark.parametrize("cache_class", [DynamicCache, StaticCache])
def test_the_cache_holds_the_latent_and_rotary_key_alone(cache_class) -> None:
    """The bytes of HF's cache tensors per token and layer: kv_lora_rank + qk_rope_head_dim
    numbers, as many as HF's own module caches (it stores the latent in K, the rotary key
    in V; the swap, both in K and nothing in V)."""
    config = CONFIGS["v3"]()
    width = config.kv_lora_rank + config.qk_rope_head_dim
    ids, mask = padded_batch()
    B, L = ids.shape
    max_len = 16 if cache_class is StaticCache else L
    eager = eager_model("v3").eval()
    for model in (swapped(eager), eager):
        kwargs = {"max_cache_len": max_len} if cache_class is StaticCache else {}
        cache = cache_class(config=model.config, **kwargs)
        with torch.no_grad():
            model(ids, attention_mask=mask, cache=cache)
        for layer in cache.layers:
            stored = sum(t.untyped_storage().nbytes() for t in (layer.keys, layer.values))
            assert stored == B * max_len * width * 4


@pytest.mark.parametrize(
    ("family", "overrides", "message"),
    [
        ("v3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0,
                                    "factor": 2.0}}, "rope_type='dynamic'"),
        ("v2-lowrank-q-bias", {"num_key_value_heads": 2}, "num_key_value_heads=2"),
        ("v3-halves-bias-yarn", {"rope_parameters": TINY_YARN | {"partial_rotary_factor": 0.5}},
         "rotary frequencies for 4 features .* qk_rope_head_dim=8"),
    ],
    ids=["dynamic_rope", "kv_heads", "partial_rotary"],
)  # fmt: skip
def test_the_swap_refuses_what_the_layer_does_not_compute_by_name(family, overrides, message):
    model = eager_model(family, **overrides)
    with pytest.raises(ValueError, match=message):
        swapped(model)


def test_a_model_cast_after_it_was_built_is_refused_for_its_inv_freq() -> None:
    model = eager_model("v3").to(torch.bfloat16)
    with pytest.raises(ValueError, match="inv_freq in torch.bfloat16"):
        swapped(model)
    swapped(eager_model("v3")).to(torch.bfloat16)(padded_batch()[0])  # swapped first: runs


@pytest.mark.parametrize("family", CONFIGS)
def test_a_swapped_model_saves_in_hf_layout_and_reloads_through_stock_from_pretrained(
    family, tmp_path
) -> None:
    """The MLA layer's Q, latent, up-projection and rotary rows (YaRN's attention_factor
    folded in) written back in HF's layout. Before: HF's ``from_pretrained`` left the
    attention at random (3.8 off)."""
    ours = perturbed(swapped(eager_model(family).eval()))
    assert_saves_as_it_loads(ours, swapped, tmp_path, *padded_batch(), tolerance=TOLERANCE)
