"""The encoder-decoder Transformer (plain ``nn.Module``, no Lightning), its dropout (from
16-bit random numbers, :class:`Dropout`), the factory that builds it from a run config
(:func:`build_model`; :func:`check_model_config` checks a config before any data is loaded),
and its decoders."""

from multihead.model.decoding import beam_search, decode, greedy_decode, max_output_lengths
from multihead.model.dropout import Dropout
from multihead.model.embedding import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    TransformerEmbedding,
    make_token_embedding,
)
from multihead.model.factory import build_model, check_model_config
from multihead.model.transformer import (
    DecoderCache,
    DecoderLayer,
    EncoderLayer,
    FeedForward,
    FullPrefix,
    Transformer,
)

__all__ = [
    "DecoderCache",
    "DecoderLayer",
    "Dropout",
    "EncoderLayer",
    "FeedForward",
    "FullPrefix",
    "LearnedPositionalEmbedding",
    "SinusoidalPositionalEncoding",
    "Transformer",
    "TransformerEmbedding",
    "beam_search",
    "build_model",
    "check_model_config",
    "decode",
    "greedy_decode",
    "make_token_embedding",
    "max_output_lengths",
]
