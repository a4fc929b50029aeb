"""Data for translation: corpus loading, joint BPE tokenizer, token batching, DataModule.

The same corpus's sentences as blocks for a causal language model are in
:mod:`multihead.data.lm` (imported on its own, not from here).

``TranslationDataModule`` is imported when first asked for: it is a Lightning DataModule, and
importing Lightning (and through it ``torch._dynamo``) costs seconds that evaluating,
translating or exporting a checkpoint does not need.
"""

from typing import TYPE_CHECKING

from multihead.data.batching import (
    TokenBucketSampler,
    batches_by_length,
    collate,
    example_length,
    pack_batches,
    real_token_fraction,
    shard_batch,
)
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

if TYPE_CHECKING:
    from multihead.data.datamodule import TranslationDataModule


def __getattr__(name: str):
    if name == "TranslationDataModule":
        from multihead.data.datamodule import TranslationDataModule

        return TranslationDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
