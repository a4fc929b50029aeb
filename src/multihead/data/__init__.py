"""Data for translation: corpus loading, joint BPE tokenizer, token batching, DataModule."""

from multihead.data.batching import (
    TokenBucketSampler,
    batches_by_length,
    collate,
    example_length,
    pack_batches,
    real_token_fraction,
    shard_batch,
)
from multihead.data.datamodule import TranslationDataModule
from multihead.data.loading import (
    DataError,
    FilterStats,
    available_local_languages,
    content_hash,
    filter_parallel_dataset,
    load_parallel_dataset,
    read_lines,
)
from multihead.data.tokenizer import Tokenizer, load_or_train_tokenizer

__all__ = [
    "DataError",
    "FilterStats",
    "TokenBucketSampler",
    "Tokenizer",
    "TranslationDataModule",
    "available_local_languages",
    "batches_by_length",
    "collate",
    "content_hash",
    "example_length",
    "filter_parallel_dataset",
    "load_or_train_tokenizer",
    "load_parallel_dataset",
    "pack_batches",
    "read_lines",
    "real_token_fraction",
    "shard_batch",
]
