"""Hugging Face models on the layer's kernels, and on the layer itself.

Builds small random models (no Hub): a Llama-shaped one with GQA (4 query heads, 2 K/V
heads) and a GPT-2, runs a left-padded batch through HF's ``eager`` attention, HF's ``sdpa``
(for scale), ``attn_implementation="multihead"`` and ``"multihead_math"``, and the module
swap of each (the Llama's with the layer's own rotary positions), and greedy-decodes 10
tokens with HF's cache each way. Prints the largest logit
difference at the token positions and whether the generated tokens are identical; exits with
status 1 if a difference reaches 1e-5 or the tokens differ. Needs the ``hf`` extra
(``pip install 'multihead[hf]'``).

    OMP_NUM_THREADS=1 python docs/examples/hf_models.py
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from multihead.integrations.huggingface import register, replace_hf_attention

# initializer_range 0.2 (HF's default is 0.02): logits far from uniform, so greedy decoding
# changes token from step to step and a wrong cache would show.
TOKENS = dict(vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=None)
TOKENS |= dict(initializer_range=0.2)


def compare(name: str, ours, eager, ids, mask) -> dict:
    keep = mask.bool()
    with torch.no_grad():
        diff = ours(ids, attention_mask=mask).logits - eager(ids, attention_mask=mask).logits
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False)
    same = torch.equal(ours.generate(ids, **kwargs), eager.generate(ids, **kwargs))
    result = {"max_diff": diff[keep].abs().max().item(), "same_tokens": same}
    print(f"{name:<34} max logit difference {result['max_diff']:.1e}, same tokens: {same}")
    return result


def main(argv: list[str] | None = None) -> dict:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    register()  # "multihead", "multihead_math", "multihead_fa", ... in HF's interfaces
    ids = torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second prompt is left-padded
    ids = ids.masked_fill(mask == 0, 0)

    torch.manual_seed(0)
    llama = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, **TOKENS)  # fmt: skip
    eager = AutoModelForCausalLM.from_config(llama, attn_implementation="eager").eval()
    results = {}
    # HF's own SDPA first, for scale; then the layer's sdpa and math backends.
    for implementation in ("sdpa", "multihead", "multihead_math"):
        ours = copy.deepcopy(eager)
        ours.set_attn_implementation(implementation)  # or from_config(attn_implementation=)
        label = f"Llama (GQA), {implementation}"
        results[implementation] = compare(label, ours, eager, ids, mask)
    swapped = replace_hf_attention(copy.deepcopy(eager))  # MultiHeadAttention with RoPE inside
    results["llama_swap"] = compare("Llama (GQA), module swap (sdpa)", swapped, eager, ids, mask)

    gpt2 = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **TOKENS)
    eager = AutoModelForCausalLM.from_config(gpt2, attn_implementation="eager").eval()
    swapped = replace_hf_attention(copy.deepcopy(eager))
    results["gpt2_swap"] = compare("GPT-2, module swap (sdpa)", swapped, eager, ids, mask)
    if any(r["max_diff"] >= 1e-5 or not r["same_tokens"] for r in results.values()):
        sys.exit(1)
    return results


if __name__ == "__main__":
    main()
