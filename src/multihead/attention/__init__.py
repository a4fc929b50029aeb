"""The reusable attention layer. Imports torch only (no Lightning, no Hydra)."""

from multihead.attention.backends import (
    BACKENDS,
    BackendUnavailableError,
    available_backends,
)
from multihead.attention.kv_cache import KVCache
from multihead.attention.layer import MultiHeadAttention
from multihead.attention.masks import AttentionMask, build_attention_mask

__all__ = [
    "BACKENDS",
    "AttentionMask",
    "BackendUnavailableError",
    "KVCache",
    "MultiHeadAttention",
    "available_backends",
    "build_attention_mask",
]
