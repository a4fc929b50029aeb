"""Every causal LM of ``transformers`` built with ``attn_implementation="multihead"``: it runs
on the layer's kernels and matches ``eager``, or it is refused by name.

The models come from HF's causal-LM auto mapping (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``),
each built from its default config made small (hidden size 32, 2 layers, 4 heads, vocabulary
128) with random weights. Skipped, with the reason: encoder-decoders, configs the small sizes
do not reach (nested sub-configs, multimodal: over 3M parameters), configs whose eager model
does not build or run at these sizes, and models without an attention module (at these
sizes: the 2 layers of a hybrid may both be recurrent). The rest are compared with the same
weights under ``eager``, on a short causal input in eval mode.

Counts (exact / refused / skipped, ``docs/reuse.md``): each passing case prints one line,
``sweep: <model_type> exact|refused``; run with ``-s -rs``.
"""

from __future__ import annotations

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
MAX_PARAMETERS = 3_000_000
TOLERANCE = 1e-5


@pytest.fixture(scope="module", autouse=True)
def quiet_and_registered():
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    hf.register()
    yield
    transformers.logging.set_verbosity(verbosity)


def small_config(model_type: str):
    config = CONFIG_MAPPING[model_type]()
    for name, value in SMALL.items():
        try:
            setattr(config, name, value)
        except Exception:  # a config that validates the field keeps its own value
            pass
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
    if not any("Attention" in type(m).__name__ for m in eager.modules()):
        pytest.skip("no attention module at the small sizes")
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            logits = eager(ids).logits
    except Exception as err:
        pytest.skip(f"eager does not run at the small sizes: {type(err).__name__}")
    return eager, ids, logits


@pytest.mark.parametrize("model_type", list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
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
        print(f"sweep: {model_type} refused")
        return
    assert calls, f"{type(eager).__name__} never called the multihead attention function"
    assert (got - want).abs().max() < TOLERANCE
    print(f"sweep: {model_type} exact")


def test_a_refused_model_is_named_with_the_reason_and_the_swap() -> None:
    with pytest.raises(ValueError, match=r"^BloomForCausalLM computes its attention in its own"):
        build("bloom", "multihead")
    # A model the swap supports is pointed to it (GPT-2 routes through the interface: its
    # refusal is the message a non-routing GPT-2 would get).
    message = hf.refusal(transformers.GPT2LMHeadModel, "multihead")
    assert "call replace_hf_attention(model) (GPT2Attention supported)" in message
