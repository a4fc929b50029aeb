"""An HF model on the layer's kernels (``attn_implementation="multihead_<backend>"``) on the
fake cuda:0: a tiny Llama (rotary positions, GQA) built from its config, a forward pass of a
left-padded batch and a short greedy ``generate`` with HF's cache, with every backend in each
precision its kernel takes. Needs the ``hf`` extra (``transformers``)."""

from __future__ import annotations

import pytest
import torch
from harness import AUTOCAST, CUDA, FakeCuda, autocast, kernel_stubs

pytest.importorskip("transformers", reason="transformers is the [hf] extra")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    LlamaConfig,
    StoppingCriteria,
    StoppingCriteriaList,
)

from multihead.integrations import huggingface as hf  # noqa: E402

pytestmark = pytest.mark.fake_cuda

B, PROMPT, NEW = 2, 6, 3
# Head size 16 (FlexAttention's least on CUDA), 2 K/V heads for 4 query heads.
CONFIG = dict(
    vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
    eos_token_id=None,
)  # fmt: skip

CASES = [
    *[(b, p) for b in ("math", "sdpa", "efficient", "flex") for p in ("fp32", "bf16")],
    ("cudnn", "bf16"),
]
# Under autocast HF Llama's rotary positions give fp32 queries and keys (bf16 projections
# times fp32 cos/sin) beside bf16 values, and the attention function passes them on as they
# are: SDPA's dispatcher casts them back (math, sdpa, efficient), flex gets mixed dtypes, and
# the check of cudnn (and flash, flash_attn) refuses float32. Each fails as it would on a GPU.


class StopAfter(StoppingCriteria):
    """Ends ``generate`` at ``length`` tokens. HF asks the device whether every row is done
    (``bool(unfinished.max() == 0)``); the fake device answers ``Answers.flag``, so this
    raises the flag when the last token is in (and keeps it down before: HF's mask reads
    ``padding_mask.all()`` the same way, and must see the padding)."""

    def __init__(self, fake: FakeCuda, length: int) -> None:
        self.fake, self.length = fake, length

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.fake.answers.flag = input_ids.shape[1] >= self.length
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@pytest.mark.parametrize(("backend", "precision"), CASES, ids=[f"{b}-{p}" for b, p in CASES])
def test_llama_forward_and_generate(backend: str, precision: str) -> None:
    names = hf.register()
    name = next(n for n, b in names.items() if b == backend)
    fake = FakeCuda()
    with kernel_stubs() as kernels:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), attn_implementation=name)
        model = fake.model(model).eval()
        with fake, torch.no_grad(), autocast(AUTOCAST[precision]):
            ids = torch.randint(2, 64, (B, PROMPT), device=CUDA)
            mask = torch.ones(B, PROMPT, dtype=torch.long, device=CUDA)
            mask[1, :2] = 0  # the second prompt is left-padded
            logits = model(ids, attention_mask=mask).logits
            forward = list(kernels)
            stop = StoppingCriteriaList([StopAfter(fake, PROMPT + NEW)])
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                stopping_criteria=stop,
            )  # fmt: skip
    dtype = AUTOCAST[precision] or torch.float32
    assert (logits.device, logits.dtype, logits.shape) == (CUDA, dtype, (B, PROMPT, 64))
    assert (out.device, out.shape) == (CUDA, (B, PROMPT + NEW))
    # Each layer's attention reached the named kernel: the forward pass, then the prefill
    # and NEW - 1 single-token steps of generate (cuDNN's single queries by the formula).
    fused = backend not in ("math", "sdpa")
    layers = CONFIG["num_hidden_layers"]
    assert forward == ([backend] * layers if fused else [])
    steps = 1 if backend == "cudnn" else NEW
    assert kernels[len(forward) :] == ([backend] * layers * steps if fused else [])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_prepared_model_generates_on_cuda_with_the_append_cache(precision: str) -> None:
    """``prepare_for_decoding`` on a CUDA model: its packed linear layers step aside for
    ``F.linear`` (oneDNN is CPU only) and make no copy; ``AppendCache`` grows on the device;
    single-token GQA steps go through the folded SDPA call."""
    from multihead.packed import PackedLinear

    hf.register()
    fake = FakeCuda()
    with kernel_stubs():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            LlamaConfig(**CONFIG), attn_implementation="multihead"
        )
        model = hf.prepare_for_decoding(fake.model(model))
        cache = hf.AppendCache(config=model.config)
        with fake, torch.no_grad(), autocast(AUTOCAST[precision]):
            ids = torch.randint(2, 64, (B, PROMPT), device=CUDA)
            stop = StoppingCriteriaList([StopAfter(fake, PROMPT + NEW)])
            out = model.generate(
                ids, max_new_tokens=NEW, do_sample=False, stopping_criteria=stop, cache=cache
            )
    assert (out.device, out.shape) == (CUDA, (B, PROMPT + NEW))
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(m._packed is None for m in packed)
    keys = cache.layers[0].keys
    assert keys.device == CUDA and keys.shape[-2] == PROMPT + NEW - 1
