"""multihead: a reusable multi-head attention layer and a small translation Transformer."""

from multihead.attention import (
    BackendUnavailableError,
    KVCache,
    MultiHeadAttention,
    replace_torch_attention,
)

__all__ = ["BackendUnavailableError", "KVCache", "MultiHeadAttention", "replace_torch_attention"]
__version__ = "0.1.0"
