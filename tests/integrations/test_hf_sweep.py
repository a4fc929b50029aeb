"""Every causal LM of ``transformers`` built with ``attn_implementation="multihead"``: it runs
on the layer's kernels and matches ``eager``, or it is refused by name.

The models come from HF's causal-LM auto mapping (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``),
each built from its default config made small, with random weights: hidden size 32, 2 layers
(one of each kind a hybrid has), 4 heads, vocabulary 128, in every sub-config (a multimodal
model's text and vision parts); where a config has them, 4 experts, MLA ranks of 32, a
sliding window of 4 and a sparse-attention indexer keeping 4 keys, on 12 tokens. Skipped,
with the reason: encoder-decoders, configs the small sizes do not reach (over 8M
parameters), configs whose eager model does not build or run at these sizes, and models
without an attention module. The rest are compared with the same weights under ``eager``,
on a causal input in eval mode.

Counts (exact / refused / skipped, ``docs/reuse.md``): each passing case prints one line,
``sweep: <model_type> exact`` or ``sweep: <model_type> refused: <message>``; run with
``-s -rs``.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is the [hf] extra")

import transformers  # noqa: E402
from transformers import CONFIG_MAPPING, AttentionInterface, AutoModelForCausalLM  # noqa: E402
from transformers.models.auto.modeling_auto import (  # noqa: E402
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
)

from multihead.integrations import huggingface as hf  # noqa: E402

SMALL = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, vocab_size=128, head_dim=8, max_position_embeddings=64,
)  # fmt: skip
# Set where a config has the field (not None): mixture of experts, latent attention (MLA),
# sparse attention's indexer keeping 4 of the 12 keys, and a sliding window of 4.
SMALLER = dict(
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, n_shared_experts=1,
    n_group=1, topk_group=1, first_k_dense_replace=1,
    q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    index_topk=4, index_n_heads=2, index_head_dim=16, sliding_window=4,
    rotary_dim=4, attention_hidden_size=32, lru_width=32, num_kv_shared_layers=0,
    vocab_size_per_layer_input=128, hidden_size_per_layer_input=8,
)  # fmt: skip
# MiniMax-M3 builds its sparse indexer only on layers of this type (none by default); its
# blocks of 2 keys, 2 of them kept beside the query's own. Hybrids that place their attention
# layers by other fields than layer_types: the second of the two layers.
OVERRIDES = {
    "minimax_m3_vl_text": dict(
        layer_types=["minimax_m3_sparse"] * 2, index_block_size=2, index_topk_blocks=2
    ),
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2),
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
}
# No softmax attention, whatever a module's name says: no implementation name reaches it.
RECURRENT = {"rwkv": "RwkvSelfAttention is RWKV's time mixing, a recurrence"}
LENGTH = 12  # tokens, above every window and top-k above
# Refused by a rule that read the whole file (issue 66), these must run.
NOT_REFUSED = {
    "got_ocr2": "its vision attention reads neither the name nor a mask; its Qwen2 routes",
}
MAX_PARAMETERS = 8_000_000
TOLERANCE = 1e-5


@pytest.fixture(scope="module", autouse=True)
def quiet_and_registered():
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    hf.register()
    yield
    transformers.logging.set_verbosity(verbosity)


def _shrink(config, fields: dict) -> None:
    # One layer of each kind a hybrid has (its attention is seldom among its first two).
    kinds = list(dict.fromkeys(_get(config, "layer_types") or []))
    if kinds and "layer_types" not in fields:
        layers = kinds * 2 if len(kinds) == 1 else kinds
        fields = fields | dict(num_hidden_layers=len(layers), layer_types=layers)
    for name, value in fields.items():
        try:
            setattr(config, name, value)
        except Exception:  # a config that validates the field keeps its own value
            pass
    for key in getattr(config, "sub_configs", {}):  # a multimodal model's text, vision, ...
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "sub_configs"):
            _shrink(sub, SMALL | _present(sub) | dict(pad_token_id=0))


def _present(config) -> dict:
    fields = {k: v for k, v in SMALLER.items() if _has(config, k)}
    if "kv_lora_rank" in fields:  # latent attention expands K and V to every query head
        fields["num_key_value_heads"] = SMALL["num_attention_heads"]
    if {"num_experts", "num_local_experts", "n_routed_experts"} & set(fields):
        fields |= dict(num_experts_per_tok=2, moe_intermediate_size=32)
    return fields


def _get(config, name: str):
    try:
        return getattr(config, name, None)
    except Exception:  # a per-layer field (Dots3): set, it is set on every layer
        return True


def _has(config, name: str) -> bool:
    return _get(config, name) is not None


def small_config(model_type: str):
    config = CONFIG_MAPPING[model_type]()
    _shrink(config, SMALL | _present(config) | OVERRIDES.get(model_type, {}))
    config.pad_token_id = 0
    return config


def build(model_type: str, implementation: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        small_config(model_type), attn_implementation=implementation
    ).eval()


def eager_or_skip(model_type: str):
    try:
        config = small_config(model_type)
    except Exception as err:
        pytest.skip(f"no default config: {type(err).__name__}")
    if getattr(config, "is_encoder_decoder", False):
        pytest.skip("encoder-decoder")
    try:
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        size = sum(p.numel() for p in meta.parameters())
    except Exception as err:
        pytest.skip(f"cannot be built small: {type(err).__name__}")
    if size > MAX_PARAMETERS:
        pytest.skip(f"cannot be built small: over {MAX_PARAMETERS:,} parameters at the small sizes")
    eager = build(model_type, "eager")
    if model_type in RECURRENT or not any("Attention" in type(m).__name__ for m in eager.modules()):
        pytest.skip("no attention module at the small sizes")
    ids = torch.randint(3, 100, (1, LENGTH), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            logits = eager(ids).logits
    except Exception as err:
        pytest.skip(f"eager does not run at the small sizes: {type(err).__name__}")
    return eager, ids, logits


@pytest.mark.parametrize("model_type", list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
@pytest.mark.slow  # about 200 HF models
def test_a_causal_lm_runs_on_our_kernels_exactly_or_is_refused_by_name(model_type, monkeypatch):
    eager, ids, want = eager_or_skip(model_type)
    calls = []
    function = AttentionInterface._global_mapping["multihead"]
    counting = lambda *args, **kwargs: calls.append(1) or function(*args, **kwargs)  # noqa: E731
    monkeypatch.setitem(AttentionInterface._global_mapping, "multihead", counting)
    named = {type(m).__name__ for m in eager.modules()}
    try:
        ours = build(model_type, "multihead")
        ours.load_state_dict(eager.state_dict())
        with torch.no_grad():
            got = ours(ids).logits
    except ValueError as err:
        message = str(err)
        assert "\n" not in message
        assert any(name in message for name in named), message  # the model or its module
        assert model_type not in NOT_REFUSED, f"{model_type}: {NOT_REFUSED[model_type]}"
        print(f"sweep: {model_type} refused: {message}")
        return
    assert calls, f"{type(eager).__name__} never called the multihead attention function"
    assert (got - want).abs().max() < TOLERANCE
    print(f"sweep: {model_type} exact")


# Families that computed their attention in their own code in some release of transformers.
# Which of them still do is read from the installed release by probing (below), not from this
# list: in 5.24 Falcon computed its own; in 5.25 it goes through the interface and is exact.
OWN_CODE_CANDIDATES = ["git", "bloom", "falcon", "gpt_neo", "xglm", "mpt"]
# What a refusal of each points to, where the swap covers the family.
FIX = {
    "git": "replace_hf_attention supports GPT2Attention",
    "bloom": r"replace_hf_attention\(model\) \(BloomAttention supported\)",
}


def routes_by_probe(model_type: str) -> bool:
    """Whether the installed release's ``model_type`` reaches the registered function and
    computes eager's logits with it, found without the refusal rule: built under ``eager``,
    the name is set on its configs behind HF's back, and the function's calls are counted."""
    eager = build(model_type, "eager")
    ids = torch.randint(3, 100, (1, LENGTH), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = eager(ids).logits
    calls, function = [], AttentionInterface._global_mapping["multihead"]
    counting = lambda *args, **kwargs: calls.append(1) or function(*args, **kwargs)  # noqa: E731
    AttentionInterface._global_mapping["multihead"] = counting
    try:
        for module in eager.modules():
            if getattr(module, "config", None) is not None:
                module.config._attn_implementation = "multihead"
        with torch.no_grad():
            got = eager(ids).logits
    except Exception:  # a dict of its own indexed by the name (KeyError), or a later failure
        return False
    finally:
        AttentionInterface._global_mapping["multihead"] = function
    return bool(calls) and (got - want).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("model_type", OWN_CODE_CANDIDATES)
@pytest.mark.parametrize("when", ["build", "set_attn_implementation"])
def test_a_model_is_refused_by_name_exactly_when_it_computes_attention_itself(model_type, when):
    # GIT's vision attention goes through the interface, its text attention does not: built,
    # it raised KeyError: 'multihead'; switched, its text attention read our mask (None: not
    # causal). Switched, BLOOM (and Falcon before 5.25) kept eager with a warning: never our
    # kernels. A family that goes through the interface in this release must not be refused.
    eager = build(model_type, "eager")
    if routes_by_probe(model_type):
        if when == "build":
            build(model_type, "multihead")
        else:
            eager.set_attn_implementation("multihead")
            assert eager.config._attn_implementation == "multihead"
        return
    fix = FIX.get(model_type, "replace_hf_attention supports")
    message = rf"^\w+ForCausalLM computes its attention in its own code \(([\w, ]+)\), .*{fix}"
    with pytest.raises(ValueError, match=message) as refused:
        if when == "build":
            build(model_type, "multihead")
        else:
            eager.set_attn_implementation("multihead")
    assert eager.config._attn_implementation == "eager"
    # The classes it names are attention classes of the family's own module, one of them built.
    named = re.search(message, str(refused.value)).group(1).split(", ")
    module = sys.modules[type(eager).__module__]
    assert all("Attention" in name and hasattr(module, name) for name in named), named
    assert {type(m).__name__ for m in eager.modules()} & set(named), named


def test_a_refusal_points_a_model_the_swap_supports_to_it() -> None:
    # GPT-2 routes through the interface: this is the message a GPT-2 that did not would get.
    message = hf.refusal(transformers.GPT2LMHeadModel, "multihead")
    assert "call replace_hf_attention(model) (GPT2Attention supported)" in message
