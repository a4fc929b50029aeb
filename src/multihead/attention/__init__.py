"""The reusable attention layer. Imports torch only (no Lightning, no Hydra)."""

from multihead.attention.backends import (
    BACKENDS,
    Backend,
    BackendUnavailableError,
    Reroute,
    available_backends,
    backend_rules,
    register_backend,
)
from multihead.attention.kv_cache import CacheLayout, KVCache
from multihead.attention.layer import MultiHeadAttention
from multihead.attention.masks import AttentionMask, build_attention_mask
from multihead.attention.steps import HeadDesign, PositionalPart
from multihead.attention.torch_swap import (
    TorchAttentionAdapter,
    replace_torch_attention,
    restore_torch_attention,
)

__all__ = [
    "BACKENDS",
    "AttentionMask",
    "Backend",
    "BackendUnavailableError",
    "CacheLayout",
    "HeadDesign",
    "KVCache",
    "MultiHeadAttention",
    "PositionalPart",
    "Reroute",
    "TorchAttentionAdapter",
    "available_backends",
    "backend_rules",
    "build_attention_mask",
    "register_backend",
    "replace_torch_attention",
    "restore_torch_attention",
]
