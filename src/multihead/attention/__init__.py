"""The reusable attention layer. Imports torch only (no Lightning, no Hydra)."""

from multihead.attention.backends import (
    BACKENDS,
    BackendUnavailableError,
    available_backends,
)
from multihead.attention.kv_cache import KVCache
from multihead.attention.layer import MultiHeadAttention
from multihead.attention.masks import AttentionMask, build_attention_mask
from multihead.attention.torch_swap import (
    TorchAttentionAdapter,
    replace_torch_attention,
    restore_torch_attention,
)

__all__ = [
    "BACKENDS",
    "AttentionMask",
    "BackendUnavailableError",
    "KVCache",
    "MultiHeadAttention",
    "TorchAttentionAdapter",
    "available_backends",
    "build_attention_mask",
    "replace_torch_attention",
    "restore_torch_attention",
]
