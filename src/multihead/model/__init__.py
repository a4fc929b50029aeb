"""The encoder-decoder Transformer and its decoders (plain ``nn.Module``, no Lightning)."""

from multihead.model.decoding import beam_search, decode, greedy_decode, max_output_lengths
from multihead.model.embedding import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    TransformerEmbedding,
    make_token_embedding,
)
from multihead.model.transformer import (
    DecoderCache,
    DecoderLayer,
    EncoderLayer,
    FeedForward,
    Transformer,
)

__all__ = [
    "DecoderCache",
    "DecoderLayer",
    "EncoderLayer",
    "FeedForward",
    "LearnedPositionalEmbedding",
    "SinusoidalPositionalEncoding",
    "Transformer",
    "TransformerEmbedding",
    "beam_search",
    "decode",
    "greedy_decode",
    "make_token_embedding",
    "max_output_lengths",
]
