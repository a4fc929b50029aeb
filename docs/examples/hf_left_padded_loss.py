"""The training loss of a left-padded batch: HF's ``sdpa`` and the layer against ``eager``.

A small random Llama (no Hub) in train mode, four rows of 8 tokens, two of them left-padded
(3 and 5 padding tokens), padding labelled -100. HF's causal LM predicts each label from the
position before it, so a row's first token is predicted from its last padding position: a
query row whose keys are all masked. There ``eager`` averages every value (softmax of equal
scores), HF's ``sdpa`` gives what its kernel gives, the layer gives zeros; the loss differs
from ``eager`` by the same amount for HF's ``sdpa``, ``attn_implementation="multihead"`` and
the module swap. Labelling each row's first token -100 as well (nothing precedes it) removes
the difference. Prints each loss minus ``eager``'s, both ways.

    OMP_NUM_THREADS=1 python docs/examples/hf_left_padded_loss.py
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from multihead.integrations.huggingface import register, replace_hf_attention


def main() -> dict[str, dict[str, float]]:
    register()
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )  # fmt: skip
    eager = AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()
    ids = torch.randint(2, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[1, :3] = 0
    mask[3, :5] = 0
    ids = ids.masked_fill(mask == 0, 0)
    first = torch.zeros_like(mask, dtype=torch.bool)
    first[torch.arange(4), (mask == 0).sum(1)] = True  # each row's first token
    labelled = {
        "padding -100": ids.masked_fill(mask == 0, -100),
        "padding and first token -100": ids.masked_fill((mask == 0) | first, -100),
    }
    results = {}
    for name, labels in labelled.items():
        want = eager(ids, attention_mask=mask, labels=labels).loss
        results[name] = {}
        for path in ("sdpa", "multihead", "swap"):
            model = copy.deepcopy(eager)
            if path == "swap":
                replace_hf_attention(model)
            else:
                model.set_attn_implementation(path)
            loss = model(ids, attention_mask=mask, labels=labels).loss
            results[name][path] = (loss - want).item()
        print(f"{name:<30}", "  ".join(f"{p} {d:+.2e}" for p, d in results[name].items()))
    return results


if __name__ == "__main__":
    main()
