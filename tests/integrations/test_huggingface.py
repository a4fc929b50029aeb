"""HF models on the layer's kernels (``attn_implementation``) and on the layer (the swap).

The reference is the same HF model with ``attn_implementation="eager"``: HF's written-out
attention, its own mask and cache. Models are built from small configs with random weights
(no Hub). ``initializer_range=0.2`` (HF's default is 0.02) makes the logits far from uniform,
so a greedy generation changes token from step to step and a wrong cache shows.

Logits are compared at the positions that are tokens: at a padding position no key is left
to attend to, where eager averages every value and the layer gives zeros (no later token
reads them, both mask the padding keys).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is the [hf] extra")

from transformers import (  # noqa: E402
    AttentionInterface,
    AutoModelForCausalLM,
    DeepseekV32Config,
    Gemma2Config,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from multihead.attention import (  # noqa: E402
    BackendUnavailableError,
    MultiHeadAttention,
    available_backends,
    prune_heads,
    with_kv_heads,
    with_kv_latent,
)
from multihead.integrations import huggingface as hf  # noqa: E402

from helpers.hf import (  # noqa: E402
    assert_saves_as_it_loads,
    max_token_difference,
    padded_batch,
    perturbed,
)

COMMON = dict(vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=None)
COMMON |= dict(initializer_range=0.2)
DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
GPT2 = dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0)
CONFIGS = {
    "llama": lambda: LlamaConfig(num_key_value_heads=2, **DECODER, **COMMON),  # GQA
    "qwen2": lambda: Qwen2Config(num_key_value_heads=2, **DECODER, **COMMON),  # GQA, Q/K/V bias
    "gpt2": lambda: GPT2Config(attn_pdrop=0.0, **GPT2, **COMMON),
    # MQA and a window of 3 keys: HF's sliding-window mask function, through ours.
    "mistral": lambda: MistralConfig(num_key_value_heads=1, sliding_window=3, **DECODER, **COMMON),
    # The swap's per-layer scale, 1/sqrt(D) / (layer_idx + 1).
    "gpt2-layer-scaled": lambda: GPT2Config(
        attn_pdrop=0.0, scale_attn_by_inverse_layer_idx=True, **GPT2, **COMMON
    ),
}
TOLERANCE = 1e-5


@pytest.fixture(scope="module", autouse=True)
def registered():
    return hf.register()


def eager_model(family: str, **overrides):
    torch.manual_seed(0)
    config = CONFIGS[family]()
    for name, value in overrides.items():
        setattr(config, name, value)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def through(model, path: str, backend: str = hf.DEFAULT_BACKEND):
    """A copy of ``model`` with its attention through ``path``: "interface" or "swap"."""
    ours = copy.deepcopy(model)
    if path == "swap":
        return hf.replace_hf_attention(ours, backend=backend)
    name = "multihead" if backend == hf.DEFAULT_BACKEND else hf.hf_name(backend)
    ours.set_attn_implementation(name)
    return ours


def left_padded_batch():
    """Two prompts of 8, the second of 5 tokens after 3 left-padding ones: for generation."""
    ids, mask = padded_batch()
    return ids[:2], mask[:2]


SWAPPED = ["llama", "qwen2", "mistral", "gpt2", "gpt2-layer-scaled"]
PATHS = [(f, "interface") for f in CONFIGS] + [(f, "swap") for f in SWAPPED]


@pytest.mark.parametrize(("family", "path"), PATHS)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_logits_match_eager_with_padding(family: str, path: str, training: bool) -> None:
    eager = eager_model(family)
    ours = through(eager, path)
    eager.train(training)
    ours.train(training)
    ids, mask = padded_batch()
    assert max_token_difference(ours, eager, ids, mask) < TOLERANCE
    assert max_token_difference(ours, eager, ids, torch.ones_like(mask)) < TOLERANCE


@pytest.mark.parametrize("backend", available_backends("cpu", torch.float32))
def test_every_backend_that_runs_here_matches_eager(backend: str) -> None:
    eager = eager_model("llama").eval()
    ours = through(eager, "interface", backend)
    with torch.no_grad():  # flex has no backward on the CPU
        assert max_token_difference(ours, eager, *padded_batch()) < TOLERANCE


def test_without_the_mask_function_a_left_padded_row_is_wrong() -> None:
    # Why register() registers a mask: under a name HF has no mask function for, the model
    # gets no mask at all and the left-padded row attends to its padding.
    AttentionInterface.register("multihead_unmasked", hf.attention_function("sdpa"))
    try:
        eager = eager_model("llama").eval()
        ours = copy.deepcopy(eager)
        ours.set_attn_implementation("multihead_unmasked")
        ids, mask = padded_batch()
        assert max_token_difference(ours, eager, ids[1:2], mask[1:2]) > 1e-2
    finally:
        del AttentionInterface._global_mapping["multihead_unmasked"]


def test_attention_weights_match_eager() -> None:
    eager = eager_model("llama").eval()
    ours = through(eager, "interface")
    ids, mask = padded_batch()
    keep = mask.bool()[:, None, :, None]  # query rows that are tokens
    got = ours(ids, attention_mask=mask, output_attentions=True).attentions
    want = eager(ids, attention_mask=mask, output_attentions=True).attentions
    for a, b in zip(got, want, strict=True):
        assert ((a - b) * keep).abs().max() < TOLERANCE


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_swap_refuses_output_attentions_by_name(family: str) -> None:
    # HF records the weights from its own attention classes; the swapped model would
    # return attentions=() (25fe9c2).
    eager = eager_model(family).eval()
    ours = through(eager, "swap")
    with pytest.raises(ValueError, match=r"^output_attentions=True: .* replace_hf_attention"):
        ours(*padded_batch(), output_attentions=True)
    eager.config.output_attentions = True  # asked by the config (HF allows it under eager)
    with pytest.raises(ValueError, match=r"^output_attentions=True"):
        through(eager, "swap")(*padded_batch())


def generate(model, ids, mask, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, **kwargs)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize(
    ("family", "path"),
    [(f, "interface") for f in ("llama", "qwen2", "gpt2")]
    + [(f, "swap") for f in ("llama", "qwen2", "mistral", "gpt2")],
)
def test_greedy_generation_equals_eager_with_hf_cache(family: str, path: str, cache: str) -> None:
    # A static cache's prefill has fewer queries than keys with nothing cached: HF's SDPA
    # mask skips it there (top-left causality), ours must not (the unpadded row alone).
    eager = eager_model(family).eval()
    ours = through(eager, path)
    ids, mask = left_padded_batch()
    for rows in (slice(None), slice(0, 1)):
        want = generate(eager, ids[rows], mask[rows], cache_implementation=cache)
        assert all(len(set(row[8:].tolist())) >= 3 for row in want)  # the test can tell
        assert torch.equal(generate(ours, ids[rows], mask[rows], cache_implementation=cache), want)


def _static_cache_loop(model, ids, steps: int = 8):
    """HF's documented decoding loop over a ``StaticCache`` (docs "Caching", "Cache
    position"): the prompt, then one token at a time, each call given ``cache_position``.
    Returns the greedy tokens ``(B, steps)`` and each step's last logits ``(B, steps, V)``."""
    from transformers import StaticCache

    B, L = ids.shape
    cache = StaticCache(config=model.config, max_cache_len=L + steps)
    cache_position = torch.arange(L)
    tokens, logits = [], []
    with torch.no_grad():
        out = model(ids, cache=cache, cache_position=cache_position, use_cache=True)
        for _ in range(steps):
            logits.append(out.logits[:, -1])
            tokens.append(out.logits[:, -1:].argmax(-1))  # (B, 1)
            cache_position = cache_position[-1:] + 1
            out = model(tokens[-1], cache=cache, cache_position=cache_position, use_cache=True)
    return torch.cat(tokens, dim=1), torch.stack(logits, dim=1)


@pytest.mark.parametrize(
    ("family", "path", "backend"),
    [("llama", "interface", "sdpa"), ("llama", "interface", "math"), ("qwen2", "interface", "sdpa")]
    + [("llama", "swap", "sdpa"), ("mistral", "swap", "sdpa")],
)
def test_hf_documented_static_cache_loop_with_cache_position_equals_eager(family, path, backend):
    """``cache_position=`` places the new keys in the cache before the attention function
    runs; HF's own sdpa function ignores it. Before, the interface refused it by name."""
    eager = eager_model(family).eval()
    ours = through(eager, path, backend)
    ids = padded_batch()[0][:1]  # (1, 8), no padding
    want_tokens, want = _static_cache_loop(eager, ids)
    got_tokens, got = _static_cache_loop(ours, ids)
    assert len(set(want_tokens[0].tolist())) >= 3  # the loop's tokens change: a test that tells
    assert torch.equal(got_tokens, want_tokens) and (got - want).abs().max() < TOLERANCE


# What the keywords HF's sdpa function ignores and the kernels take as they are could hold.
_PASSED_VALUES = {
    "sliding_window": 3, "position_ids": torch.arange(8)[None],
    "cu_seq_lens_q": torch.tensor([0, 8]), "cu_seq_lens_k": torch.tensor([0, 8]),
    "max_length_q": 8, "max_length_k": 8,
    "seq_idx": torch.zeros(1, 8, dtype=torch.int32), "use_cache": True,
    "output_hidden_states": True, "output_router_logits": True,
    "num_items_in_batch": torch.tensor(8), "logits_to_keep": 1,
    "cache_position": torch.arange(8), "deterministic": True,
}  # fmt: skip


def test_every_keyword_passed_is_one_hf_sdpa_function_ignores_too() -> None:
    """The list that passes, against HF's own sdpa function: it never reads these keywords
    (its source), its output is the same with each as without, and so is ours (within
    float error of HF's). ``output_attentions`` is honoured through the math path
    (``test_attention_weights_match_eager``)."""
    import inspect

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    assert set(_PASSED_VALUES) == hf.HONOURED - {"output_attentions"}
    source = inspect.getsource(sdpa_attention_forward)
    module = eager_model("llama").model.layers[0].self_attn
    q = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    k, v = torch.randn(2, 1, 2, 8, 8, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]  # HF's: True = attend
    plain = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)[0]
    ours = hf.attention_function("sdpa")
    for name, value in _PASSED_VALUES.items():
        assert name not in source
        theirs = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3, **{name: value})[0]
        assert torch.equal(theirs, plain)
        got = ours(module, q, k, v, mask, scaling=0.3, **{name: value})[0]
        assert (got - theirs).abs().max() < TOLERANCE, name


@pytest.mark.parametrize("name", hf.FEATURES)
def test_a_keyword_that_changes_the_scores_is_refused_by_name(name) -> None:
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match=rf"^LlamaAttention passes {name}= \(.+\), which backend"):
        hf.attention_function("sdpa")(
            eager_model("llama").model.layers[0].self_attn, q, q, q, None, **{name: torch.ones(1)}
        )


def test_the_refused_keywords_change_what_hf_computes() -> None:
    """Two of the refused list against HF's own functions: Gemma 2's eager attention with
    ``softcap`` and HF's sdpa function with ``position_bias`` compute other outputs than
    without them (DeepSeek-V3.2's ``indices``: ``test_sparse_attention_is_refused_...``)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    module = eager_model("llama").model.layers[0].self_attn  # 4 heads, 2 K/V heads
    q = 3 * torch.randn(1, 4, 6, 8, generator=torch.Generator().manual_seed(0))
    k, v = 3 * torch.randn(2, 1, 2, 6, 8, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(1, 4, 6, 6, generator=torch.Generator().manual_seed(2))
    for function, changed in ((eager_attention_forward, dict(softcap=2.0)),
                              (sdpa_attention_forward, dict(position_bias=bias))):  # fmt: skip
        plain = function(module, q, k, v, None, scaling=1.0)[0]
        assert (
            function(module, q, k, v, None, scaling=1.0, **changed)[0] - plain
        ).abs().max() > 0.1


def test_a_cache_that_forgets_fails_the_generation_test(monkeypatch) -> None:
    # The generation test catches a cache that drops what was written before.
    eager = eager_model("gpt2").eval()
    ours = through(eager, "swap")
    monkeypatch.setattr(hf.CacheLayer, "update", lambda self, k, v: (k, v))
    ids, mask = left_padded_batch()
    assert not torch.equal(generate(ours, ids, mask), generate(eager, ids, mask))


def test_swapped_gpt2_as_gqa_generates_with_hf_cache_as_without() -> None:
    model = through(eager_model("gpt2").eval(), "swap")
    for block in model.transformer.h:
        block.attn.attn = with_kv_heads(block.attn.attn, 2)  # HF's cache holds 2 K/V heads
    ids, mask = left_padded_batch()
    cached = generate(model, ids, mask)
    assert model.transformer.h[0].attn.attn.num_kv_heads == 2
    assert torch.equal(cached, generate(model, ids, mask, use_cache=False))


@pytest.mark.parametrize(
    ("family", "path"),
    [("llama", "interface"), ("gpt2", "interface"), ("llama", "swap"), ("gpt2", "swap")],
)
def test_compiles_without_graph_breaks(family: str, path: str) -> None:
    torch._dynamo.reset()
    eager = eager_model(family).eval()
    ours = through(eager, path)
    compiled = torch.compile(ours, fullgraph=True, backend="eager")  # a graph break raises
    with torch.no_grad():
        assert max_token_difference(compiled, eager, *padded_batch()) < TOLERANCE
    torch._dynamo.reset()


def test_a_backend_that_cannot_run_here_raises_our_error() -> None:
    missing = [b for b in hf.BACKENDS if b not in available_backends("cpu", torch.float32)]
    ours = through(eager_model("llama"), "interface", missing[0])
    with pytest.raises(BackendUnavailableError, match=f"'{missing[0]}' cannot run on cpu"):
        ours(*padded_batch())


def test_a_backend_without_dropout_refuses_the_models_attention_dropout() -> None:
    ours = through(eager_model("llama", attention_dropout=0.1), "interface", "flex").train()
    with pytest.raises(ValueError, match="backend 'flex' takes no attention dropout"):
        ours(*padded_batch())


def test_logit_softcapping_is_refused() -> None:
    torch.manual_seed(0)
    config = Gemma2Config(head_dim=8, num_key_value_heads=2, **DECODER, **COMMON)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="multihead")
    with pytest.raises(ValueError, match=r"passes softcap= \(logit softcapping"):
        model(*padded_batch())


def test_sparse_attention_is_refused_by_name_at_build_and_after_set_attn_implementation():
    # DeepSeek-V3.2 folds its indexer's top-k keys into the mask for eager and sdpa only; any
    # other function gets them as indices=. Dropped, the model ran dense: 0.24 off eager with
    # 4 of 12 keys kept (issue 66).
    mla = dict(q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8)
    moe = dict(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
    config = DeepseekV32Config(
        **DECODER, **COMMON, **mla, **moe, v_head_dim=16, num_key_value_heads=4,
        moe_intermediate_size=32, index_topk=4, index_n_heads=2, index_head_dim=16,
    )  # fmt: skip
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    switched = through(eager, "interface")
    # from_config keeps the config it is given: a copy, or this model's name changes eager's.
    built = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="multihead")
    ids = torch.randint(3, 60, (1, 12), generator=torch.Generator().manual_seed(0))
    for model in (built, switched):
        with pytest.raises(ValueError, match=r"^DeepseekV32Attention passes indices= \(sparse"):
            model(ids)


def test_a_keyword_the_function_does_not_read_is_refused_unless_it_is_none() -> None:
    attention, q = hf.attention_function("math"), torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match=r"^Linear passes window_bias=, which backend 'math'"):
        attention(torch.nn.Linear(1, 1), q, q, q, None, window_bias=torch.zeros(3))
    attention(torch.nn.Linear(1, 1), q, q, q, None, window_bias=None)


def test_flash_backends_get_names_hf_leaves_alone() -> None:
    names = hf.register()
    assert names["multihead_fa"] == "flash" and names["multihead_fa_attn"] == "flash_attn"
    assert not any("flash" in name for name in names)
    assert names["multihead"] == hf.DEFAULT_BACKEND


def test_the_swap_holds_the_layer_and_keeps_frozen_weights_frozen() -> None:
    eager = eager_model("gpt2")
    eager.transformer.h[0].attn.c_attn.requires_grad_(False)
    model = hf.replace_hf_attention(copy.deepcopy(eager))
    first, second = (block.attn.attn for block in model.transformer.h)
    assert isinstance(first, MultiHeadAttention)
    assert not first.in_proj.weight.requires_grad and not first.in_proj.bias.requires_grad
    assert first.out_proj.weight.requires_grad and second.in_proj.weight.requires_grad


def test_the_swap_takes_hf_position_ids() -> None:
    # Rotary scores depend on position differences only, so a left-padded row's offset does
    # not show; two sequences packed in one row (positions restarting at 0) do.
    eager = eager_model("llama").eval()
    ours = through(eager, "swap")
    ids = padded_batch()[0][:1]
    positions = torch.cat([torch.arange(5), torch.arange(3)])[None]  # (1, 8)

    def difference():
        got, want = (m(ids, position_ids=positions).logits for m in (ours, eager))
        return (got - want).abs().max().item()

    assert difference() < TOLERANCE
    for layer in ours.model.layers:
        layer.self_attn.forward = _dropping_position_ids(layer.self_attn.forward)
    assert difference() > 1e-3


def _hf_attention_reference(eager, x, positions):
    """HF's eager Llama attention of layer 0 on ``x`` ``(1, L, E)`` at ``positions``
    ``(1, L)``, causal: the reference for the adapter called directly."""
    L = x.shape[1]
    causal = torch.full((L, L), float("-inf")).triu(1)[None, None]  # (1, 1, L, L), additive
    rotary = eager.model.rotary_emb(x, positions)
    return eager.model.layers[0].self_attn(x, rotary, attention_mask=causal)[0], causal


def test_without_position_ids_the_swap_takes_cache_position_or_the_cache_length() -> None:
    from transformers import DynamicCache

    eager = eager_model("llama").eval()
    adapter = through(eager, "swap").model.layers[0].self_attn
    x = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(2))
    # cache_position (older HF models pass it): two sequences packed in one row.
    packed = torch.cat([torch.arange(5), torch.arange(3)])[None]
    want, causal = _hf_attention_reference(eager, x, packed)
    got = adapter(x, attention_mask=causal == 0, cache_position=packed)[0]
    assert (got - want).abs().max() < TOLERANCE
    # Neither: the positions after the cache's, 5, 6, 7 after a prompt of 5.
    want, causal = _hf_attention_reference(eager, x, torch.arange(8)[None])
    cache, mask = DynamicCache(), causal == 0  # bool, True = attend
    adapter(x[:, :5], attention_mask=mask[..., :5, :5], cache=cache)
    got = adapter(x[:, 5:], attention_mask=mask[..., 5:, :], cache=cache)[0]
    assert (got - want[:, 5:]).abs().max() < TOLERANCE


def _dropping_position_ids(forward):
    return lambda *args, position_ids=None, **kwargs: forward(*args, **kwargs)


def test_the_llama_swap_holds_the_models_own_projections() -> None:
    # Qwen2: biased q/k/v_proj beside an o_proj without bias, kept as they are; a frozen
    # k_proj stays frozen beside trainable ones.
    model = eager_model("qwen2")
    model.model.layers[1].self_attn.k_proj.requires_grad_(False)
    attention = [layer.self_attn for layer in model.model.layers]
    hf.replace_hf_attention(model)
    adapters = [layer.self_attn for layer in model.model.layers]
    for theirs, adapter in zip(attention, adapters, strict=True):
        proj = adapter.attn.in_proj
        assert (proj.q_proj, proj.k_proj, proj.v_proj) == (
            theirs.q_proj, theirs.k_proj, theirs.v_proj,
        )  # fmt: skip
        assert adapter.attn.out_proj is theirs.o_proj and theirs.o_proj.bias is None
    assert not attention[1].k_proj.weight.requires_grad and attention[1].q_proj.weight.requires_grad


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_an_optimizer_built_before_the_swap_trains_the_attention_as_on_eager(family) -> None:
    # 25fe9c2 stacked Q/K/V into a new in_proj: the optimizer's parameters never moved.
    eager = eager_model(family).train()
    ours = copy.deepcopy(eager)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, ours)]
    hf.replace_hf_attention(ours)
    before = copy.deepcopy(eager.state_dict())
    ids, mask = padded_batch()
    labels = ids.masked_fill(mask == 0, -100)
    labels[torch.arange(3), (mask == 0).long().argmin(1)] = -100  # first tokens (reuse.md)
    for model, optimizer in zip((eager, ours), optimizers, strict=True):
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
    for layer, theirs in zip(ours.model.layers, eager.model.layers, strict=True):
        proj = layer.self_attn.attn.in_proj
        ours_w = (proj.q_proj, proj.k_proj, proj.v_proj, layer.self_attn.attn.out_proj)
        eager_w = (theirs.self_attn.q_proj, theirs.self_attn.k_proj, theirs.self_attn.v_proj)
        for a, b in zip(ours_w, (*eager_w, theirs.self_attn.o_proj), strict=True):
            torch.testing.assert_close(a.weight, b.weight, atol=1e-6, rtol=0)
    changed = [k for k in before if "self_attn" in k and "weight" in k]
    assert len(changed) == 8
    assert all(not torch.equal(eager.state_dict()[k], before[k]) for k in changed)


def test_a_swap_that_copies_weights_says_an_earlier_optimizer_no_longer_trains_them() -> None:
    """GPT-2's Conv1D weights are stored transposed: the layer holds copies, so an optimizer
    built before the swap would silently stop training the attention; the swap warns. The
    Llama family keeps its own parameters and does not."""
    import warnings

    with pytest.warns(UserWarning, match=r"GPT2Attention are copied.*build it after the swap"):
        hf.replace_hf_attention(eager_model("gpt2"))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="replace_hf_attention")
        hf.replace_hf_attention(eager_model("llama"))


@pytest.mark.parametrize(
    "convert",
    [lambda a: with_kv_heads(a, 1), lambda a: prune_heads(a, [2, 3])],
    ids=["with_kv_heads", "prune_heads"],
)
def test_the_conversions_of_the_swaps_separate_projections_equal_the_stacked_ones(convert):
    # The swap holds Llama's q/k/v_proj as they are (QKVProjection.from_linears); the
    # conversions must read them as they read a stacked in_proj (the reference).
    separate = through(eager_model("llama").eval(), "swap").model.layers[0].self_attn.attn
    stacked = MultiHeadAttention(32, 4, 2, bias=False, rotary_dim=8).eval()
    with torch.no_grad():
        for ours, theirs in zip(stacked.in_proj.blocks(), separate.in_proj.blocks(), strict=True):
            ours.copy_(theirs)
        stacked.out_proj.weight.copy_(separate.out_proj.weight)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(3))
    want = convert(stacked)(x, is_causal=True)
    torch.testing.assert_close(convert(separate)(x, is_causal=True), want, atol=1e-6, rtol=0)


def test_a_partial_rotary_factor_that_hf_ignores_is_ignored_too() -> None:
    # transformers 5.24's Llama rotates every head feature whatever partial_rotary_factor
    # says; the swap follows the model's angles, not the config's word.
    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)
    eager = eager_model("llama", rope_parameters=rope).eval()
    ours = through(eager, "swap")
    assert ours.model.layers[0].self_attn.attn.positions.rotary_dim == 8  # head_dim
    assert max_token_difference(ours, eager, *padded_batch()) < TOLERANCE


LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
    high_freq_factor=4.0, original_max_position_embeddings=16,
)  # fmt: skip


@pytest.mark.parametrize(
    ("family", "overrides", "message"),
    [
        ("llama", dict(rope_parameters=LLAMA3_ROPE), r"rope_type='llama3' \(scaled rotary"),
        ("qwen2", dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0)),
         r"rope_type='linear'"),
        ("mistral", dict(head_dim=16), r"head_dim \(16\) \* num_attention_heads \(4\) must equal"),
    ],
    ids=["llama3-rope", "linear-rope", "head-dim"],
)  # fmt: skip
def test_the_swap_refuses_what_the_layer_does_not_compute(family, overrides, message) -> None:
    model = eager_model(family, **overrides)
    with pytest.raises(ValueError, match=r"cannot replace 'model.layers.0.self_attn': " + message):
        hf.replace_hf_attention(model)
    assert not any(isinstance(m, hf.HFAttentionAdapter) for m in model.modules())


def test_the_swap_refuses_rotary_angles_other_than_the_models() -> None:
    # The adapters ignore HF's position_embeddings: the swap compares them with the layer's.
    model = eager_model("llama")
    model.model.rotary_emb.attention_scaling = 0.5  # cos and sin scaled, as yarn does
    with pytest.raises(ValueError, match=r"'model.rotary_emb' \(LlamaRotaryEmbedding\) gives"):
        hf.replace_hf_attention(model)
    assert not any(isinstance(m, hf.HFAttentionAdapter) for m in model.modules())


def test_a_model_cast_to_bf16_is_refused_for_its_inv_freq_with_the_fix() -> None:
    # .to(torch.bfloat16) casts HF's inv_freq buffer too (25fe9c2 blamed the angles).
    model = eager_model("llama").to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"'model.rotary_emb' .* inv_freq in torch.bfloat16"):
        hf.replace_hf_attention(model)
    # The two fixes the message gives: build with dtype=, or swap before casting.
    built = AutoModelForCausalLM.from_config(CONFIGS["llama"](), dtype=torch.bfloat16)
    assert built.model.rotary_emb.inv_freq.dtype == torch.float32
    hf.replace_hf_attention(built)
    hf.replace_hf_attention(eager_model("llama")).to(torch.bfloat16)(*padded_batch())


def test_the_swap_refuses_cross_attention_and_replaces_nothing() -> None:
    model = eager_model("gpt2", add_cross_attention=True)
    with pytest.raises(ValueError, match=r"'transformer.h.0.crossattention'.*cross-attention"):
        hf.replace_hf_attention(model)
    assert not any(isinstance(m, hf.HFAttentionAdapter) for m in model.modules())


def test_the_swap_refuses_a_model_without_a_supported_attention() -> None:
    with pytest.raises(ValueError, match="no attention module to replace in Linear"):
        hf.replace_hf_attention(torch.nn.Linear(4, 4))


# ------------------------------------------------------------ a swapped model saves as it loads
@pytest.mark.parametrize("family", SWAPPED)
def test_a_swapped_model_saves_in_hf_names_and_reloads_through_stock_from_pretrained(
    family, tmp_path
) -> None:
    """Before: ``save_pretrained`` wrote the layer's names (``self_attn.attn.in_proj...``)
    and HF's ``from_pretrained`` left the attention at random (10.2 off on Llama)."""
    ours = perturbed(through(eager_model(family).eval(), "swap"))
    assert_saves_as_it_loads(
        ours, hf.replace_hf_attention, tmp_path, *padded_batch(), tolerance=TOLERANCE
    )


def test_a_swapped_model_loads_a_stock_models_state_dict() -> None:
    ours = through(eager_model("llama").eval(), "swap")
    other = perturbed(eager_model("llama").eval())
    ours.load_state_dict(other.state_dict())
    assert max_token_difference(ours, other, *padded_batch()) < TOLERANCE


@pytest.mark.parametrize(
    ("convert", "tag"),
    [
        (lambda attn: with_kv_heads(attn, 1), "'mqa4-rope'"),
        (lambda attn: with_kv_latent(attn, 8), "'mla4"),
        (lambda attn: prune_heads(attn, [0, 1]), "'mqa2"),
    ],
    ids=["kv-heads", "mla", "pruned"],
)
def test_a_converted_layer_refuses_hf_format_by_name_and_reloads_the_projects_way(
    convert, tag, tmp_path
) -> None:
    """A layer HF's module has no weights for (other heads, another design) is refused by
    ``save_pretrained``, naming it; ``state_dict`` keeps its own names, and the documented
    reload (build, swap, convert again, ``load_state_dict``) gives the same logits."""

    def built():
        model = through(eager_model("llama").eval(), "swap")
        model.model.layers[1].self_attn.attn = convert(model.model.layers[1].self_attn.attn)
        return model

    ours = perturbed(built())
    with pytest.raises(ValueError, match=rf"^cannot save 'model.layers.1.self_attn' .*{tag}"):
        ours.save_pretrained(tmp_path)
    assert not any(tmp_path.iterdir())
    torch.save(ours.state_dict(), tmp_path / "weights.pt")
    again = built()
    again.load_state_dict(torch.load(tmp_path / "weights.pt"))
    assert max_token_difference(again, ours, *padded_batch()) < TOLERANCE
