"""A small Llama-shaped causal LM with random weights, built from a Hugging Face ``LlamaConfig``.

The decoder-only model of issue 56's conversion study: rotary positions on every feature of
each head (HF's default RoPE), RMSNorm, SwiGLU, tied input and output embeddings.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build_llama_lm(
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int | None = None,
    intermediate_size: int,
    max_positions: int,
    rope_theta: float = 10000.0,
    pad_id: int = 0,
    bos_id: int = 1,
    eos_id: int = 2,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A randomly initialised ``LlamaForCausalLM`` (eager attention, tied embeddings).

    Args:
        vocab_size: the tokenizer's ids.
        hidden_size: ``E``; ``num_heads`` must divide it.
        num_layers: decoder layers.
        num_heads: query heads ``H``.
        num_kv_heads: K/V heads ``G`` (``None``: ``H``, MHA); must divide ``H``.
        intermediate_size: the SwiGLU's width.
        max_positions: the longest sequence the model is meant for.
        rope_theta: RoPE's base.
        pad_id, bos_id, eos_id: the tokenizer's special ids.
        seed: the weights' initialisation.
    """
    for key, value in (
        ("vocab_size", vocab_size),
        ("hidden_size", hidden_size),
        ("num_layers", num_layers),
        ("num_heads", num_heads),
        ("intermediate_size", intermediate_size),
        ("max_positions", max_positions),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive int, got {value!r}")
    if hidden_size % num_heads:
        raise ValueError(f"num_heads={num_heads} must divide hidden_size={hidden_size}")
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1:
        raise ValueError(f"num_kv_heads must be a positive int or None, got {num_kv_heads!r}")
    if num_heads % kv_heads:
        raise ValueError(f"num_kv_heads={kv_heads} must divide num_heads={num_heads}")
    if (hidden_size // num_heads) % 2:
        raise ValueError(
            f"head width hidden_size/num_heads={hidden_size // num_heads} must be even (RoPE pairs)"
        )
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_positions,
        rope_theta=rope_theta,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)
