"""A model family added from outside the package: one file, one ``register_family`` call.

The file (:data:`OPT_FAMILY`, written to a directory on ``sys.path`` and imported, as a
user's own module would be) swaps OPT's attention, which the package does not cover: its
converter puts OPT's own ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` (biased) in the
layer, and its save map renames them back. The reference is HF's eager OPT: its logits at
the positions that are tokens, its greedy tokens, and its ``from_pretrained``.
"""

from __future__ import annotations

import copy
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is the [hf] extra")

from transformers import AutoModelForCausalLM, OPTConfig  # noqa: E402

from multihead.integrations import huggingface as hf  # noqa: E402

from helpers.hf import (  # noqa: E402
    assert_saves_as_it_loads,
    max_token_difference,
    padded_batch,
    perturbed,
)

TOLERANCE = 1e-5

# The whole family, as a user writes it in a module of their own.
OPT_FAMILY = '''
"""OPT's attention on the layer: its projections are the layer's, under OPT's names."""

from transformers.models.opt.modeling_opt import OPTAttention

from multihead.attention import MultiHeadAttention, QKVProjection
from multihead.integrations import huggingface as hf

# The adapter's names (the layer's) to OPT's: OPT's own modules, held by the layer.
NAMES = {
    "attn.in_proj.q_proj.": "q_proj.", "attn.in_proj.k_proj.": "k_proj.",
    "attn.in_proj.v_proj.": "v_proj.", "attn.out_proj.": "out_proj.",
}


def from_opt(module: OPTAttention, backend: str) -> hf.HFAttentionAdapter:
    # OPT scales the projected query (bias included) and calls the kernel with scaling=1:
    # the same scores as the layer's scale on Q K^T.
    E, H = module.embed_dim, module.num_heads
    attn = MultiHeadAttention(
        E, H, dropout=module.dropout, bias=module.enable_bias, backend=backend, device="meta"
    )
    attn.scale = module.scaling
    attn.in_proj = QKVProjection.from_linears(module.q_proj, module.k_proj, module.v_proj, H, H)
    attn.out_proj = module.out_proj
    adapter = hf.HFAttentionAdapter(
        attn, layer_idx=module.layer_idx, layout=hf.HFLayout.renaming(module, NAMES)
    )
    return adapter.train(module.training)


hf.register_family(OPTAttention, convert=from_opt)
'''


@pytest.fixture
def outside(tmp_path, monkeypatch):
    """``load(module, source)``: that module written to a directory on ``sys.path`` and
    imported; after the test it is gone, and so are the families it registered."""
    monkeypatch.syspath_prepend(str(tmp_path))
    families, written = dict(hf.FAMILIES), []

    def load(module: str, source: str) -> None:
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        written.append(module)
        __import__(module)

    yield load
    for module in written:
        sys.modules.pop(module, None)
    hf.FAMILIES.clear()
    hf.FAMILIES.update(families)


def eager_opt():
    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=64, hidden_size=32, word_embed_proj_dim=32, ffn_dim=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=None, init_std=0.2,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def test_a_family_registered_from_outside_is_swapped_and_matches_eager(outside) -> None:
    eager = eager_opt()
    with pytest.raises(ValueError, match="no attention module to replace in OPTForCausalLM"):
        hf.replace_hf_attention(copy.deepcopy(eager))
    outside("opt_family", OPT_FAMILY)
    ours = hf.replace_hf_attention(copy.deepcopy(eager))
    kinds = [type(m).__name__ for m in ours.modules()]
    assert kinds.count("HFAttentionAdapter") == 2 and "OPTAttention" not in kinds
    ids, mask = padded_batch()  # left- and right-padded rows
    assert max_token_difference(ours, eager, ids, mask) < TOLERANCE
    # The cache: greedy tokens of the unpadded row, one new key per step.
    prompt = ids[:1]
    want = eager.generate(prompt, max_new_tokens=10, do_sample=False)
    torch.testing.assert_close(ours.generate(prompt, max_new_tokens=10, do_sample=False), want)


def test_a_family_registered_from_outside_saves_as_it_loads(outside, tmp_path) -> None:
    # Its save map: the stock OPT loads what the swapped one saves, every weight in place.
    outside("opt_family_saved", OPT_FAMILY)
    ours = hf.replace_hf_attention(perturbed(eager_opt()))
    ids, mask = padded_batch()
    assert_saves_as_it_loads(ours, hf.replace_hf_attention, tmp_path / "opt", ids, mask, TOLERANCE)


def test_register_family_refuses_what_is_not_a_family_in_one_line() -> None:
    families = dict(hf.FAMILIES)
    with pytest.raises(TypeError, match=r"needs HF attention classes \(nn.Module\), got none"):
        hf.register_family(convert=print)
    with pytest.raises(TypeError, match="got 'OPTAttention'"):
        hf.register_family("OPTAttention", convert=print)
    with pytest.raises(TypeError, match="convert must be callable, got 'from_opt'"):
        hf.register_family(torch.nn.Linear, convert="from_opt")
    assert hf.FAMILIES == families
