"""multihead: a reusable multi-head attention layer and a small translation Transformer."""

from multihead.attention import BackendUnavailableError, KVCache, MultiHeadAttention

__all__ = ["BackendUnavailableError", "KVCache", "MultiHeadAttention"]
__version__ = "0.1.0"
