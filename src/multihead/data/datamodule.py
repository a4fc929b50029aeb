"""Lightning DataModule: load, filter, tokenize (cached) and batch a translation corpus."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import datasets
import lightning as L
import torch
from torch.utils.data import DataLoader

from multihead.data.batching import (
    TokenBucketSampler,
    collate,
    example_length,
    real_token_fraction,
)
from multihead.data.loading import (
    SPLITS,
    content_hash,
    filter_parallel_dataset,
    load_parallel_dataset,
)
from multihead.data.tokenizer import Tokenizer, is_dropout_probability, load_or_train_tokenizer

logger = logging.getLogger(__name__)

_TOKENIZED_VERSION = "tokenized-v2"  # v2: no "index" column


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """Hide ``datasets``' progress bars for fast internal steps, then restore them."""
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if bars:
            datasets.enable_progress_bars()


class TranslationDataModule(L.LightningDataModule):
    """Multi30k-style translation data with a joint BPE and token-budget batches.

    ``prepare_data``/``setup`` load the corpus (Hub or ``local_dir``), drop empty and over-long
    pairs from train and validation (never test), cut each split to its limit, train or load
    the cached tokenizer and pre-tokenize every split (cached under ``cache_dir`` by a hash of
    the data and settings). Batches are the dicts of :func:`multihead.data.batching.collate`.

    The training sampler's position is part of ``state_dict``, which Lightning stores in
    checkpoints, so a run resumed mid-epoch sees exactly the batches it had not yet seen.

    Args:
        name, src_lang, tgt_lang, local_dir: the corpus, as for
            :func:`~multihead.data.loading.load_parallel_dataset`.
        vocab_size: Joint BPE vocabulary size.
        lowercase: Lowercase all text through the tokenizer's normalizer (as the published
            Multi30k baselines train); references stay cased for scoring, so outputs are
            lowercase and cased BLEU is low while lowercased BLEU is comparable.
        bpe_dropout: BPE-dropout for training batches (see
            :meth:`~multihead.data.tokenizer.Tokenizer.with_bpe_dropout`): each training batch
            is encoded anew, skipping each merge with this probability, so every epoch sees
            other segmentations. 0 (the default) uses the cached ids. Validation and test
            always use the usual segmentation. The sampler packs batches by the usual lengths,
            so a batch's real token count grows with ``bpe_dropout`` (about 15% at 0.1 on
            Multi30k), and the segmentations are not seeded (see ``with_bpe_dropout``).
        max_tokens: Training batch budget, ``num_sentences * longest_length`` in tokens, of one
            rank; under DDP a step's global batch has ``max_tokens * world_size``.
        max_length: Train/validation pairs with a side longer than this many words are dropped.
        eval_max_tokens: Evaluation batch budget; defaults to ``max_tokens``.
        num_workers: ``DataLoader`` worker processes.
        cache_dir: Where tokenizers and tokenized datasets are cached.
        train_limit: Keep only the first N training pairs (after filtering); None keeps all.
        val_limit: Same for validation.
        test_limit: Same for test.
        seed: Seed of the training batch order.
    """

    def __init__(
        self,
        name: str = "bentrevett/multi30k",
        src_lang: str = "en",
        tgt_lang: str = "de",
        local_dir: str | None = None,
        vocab_size: int = 8000,
        lowercase: bool = False,
        bpe_dropout: float = 0.0,
        max_tokens: int = 4096,
        max_length: int | None = 256,
        eval_max_tokens: int | None = None,
        num_workers: int = 0,
        cache_dir: str = "outputs/cache",
        train_limit: int | None = None,
        val_limit: int | None = None,
        test_limit: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for arg, value in (("vocab_size", vocab_size), ("max_tokens", max_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"data.{arg} must be a positive integer, got {value!r}")
        if not isinstance(lowercase, bool):
            raise ValueError(f"data.lowercase must be a bool, got {lowercase!r}")
        if not is_dropout_probability(bpe_dropout):
            raise ValueError(f"data.bpe_dropout must be in [0, 1), got {bpe_dropout!r}")
        if eval_max_tokens is not None and eval_max_tokens < 1:
            raise ValueError(
                f"eval_max_tokens must be a positive integer or None, got {eval_max_tokens}"
            )
        limits = {"train": train_limit, "validation": val_limit, "test": test_limit}
        for split, limit in limits.items():
            if limit is not None and limit < 1:
                raise ValueError(f"{split} limit must be a positive integer or None, got {limit}")
        self.save_hyperparameters()
        self.name = name
        self.src_lang = src_lang
        self.tgt_lang = tgt_lang
        self.local_dir = local_dir
        self.vocab_size_setting = vocab_size
        self.lowercase = lowercase
        self.bpe_dropout = float(bpe_dropout)
        self.max_tokens = max_tokens
        self.max_length = max_length
        self.eval_max_tokens = eval_max_tokens or max_tokens
        self.num_workers = num_workers
        self.cache_dir = Path(cache_dir)
        self.limits = limits
        self.seed = seed

        # Split validation and test between the ranks (DDP); False: every rank sees all.
        self.shard_eval = True
        self._tokenizer: Tokenizer | None = None
        self._datasets: datasets.DatasetDict | None = None
        self._train_sampler: TokenBucketSampler | None = None
        self._pending_sampler_state: dict[str, int] | None = None
        self._consumed_epoch: int | None = None
        self._consumed = 0

    # ----------------------------------------------------------------------- preparation

    def setup(self, stage: str | None = None) -> None:
        """Make the tokenized splits available (from the cache when ``prepare_data`` ran)."""
        self.prepare_data()

    def prepare_data(self) -> None:
        """Load the corpus and fill the tokenizer and tokenized-data caches."""
        if self._datasets is not None:
            return
        raw = load_parallel_dataset(
            self.name, self.src_lang, self.tgt_lang, local_dir=self.local_dir
        )
        raw, _ = filter_parallel_dataset(raw, max_length=self.max_length)
        limited = {}
        for split in SPLITS:
            ds, limit = raw[split], self.limits[split]
            if limit is not None and limit < len(ds):
                with quiet_datasets():
                    ds = ds.select(range(limit)).flatten_indices()
            limited[split] = ds
        raw = datasets.DatasetDict(limited)
        logger.info("pairs per split: %s", {split: len(ds) for split, ds in raw.items()})

        self._tokenizer = load_or_train_tokenizer(
            raw, self.cache_dir, self.vocab_size_setting, lowercase=self.lowercase
        )
        self._datasets = self._load_or_tokenize(raw, self._tokenizer)

    def _load_or_tokenize(
        self, raw: datasets.DatasetDict, tokenizer: Tokenizer
    ) -> datasets.DatasetDict:
        key_fields = {
            "version": _TOKENIZED_VERSION,
            "data": content_hash(raw),
            "tokenizer": tokenizer.fingerprint(),
        }
        key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:16]
        path = self.cache_dir / "tokenized" / key
        if path.is_dir():
            logger.info("loading cached tokenized splits %s", path)
            return datasets.load_from_disk(str(path))

        def tokenize(batch: dict[str, list]) -> dict[str, list]:
            src_ids = tokenizer.encode_batch(batch["src"])
            tgt_ids = tokenizer.encode_batch(batch["tgt"])
            return {
                "src_ids": src_ids,
                "tgt_ids": tgt_ids,
                "length": [
                    example_length(len(s), len(t)) for s, t in zip(src_ids, tgt_ids, strict=True)
                ],
            }

        with quiet_datasets():
            tokenized = raw.map(tokenize, batched=True, batch_size=2000)
            tmp = path.with_name(f".{key}.{os.getpid()}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tokenized.save_to_disk(str(tmp))
        try:
            os.replace(tmp, path)
        except OSError:  # another process wrote the same cache entry first
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info("tokenized splits cached in %s", path)
        return tokenized

    # ------------------------------------------------------------------------ accessors

    @property
    def tokenizer(self) -> Tokenizer:
        """The joint BPE tokenizer (available after ``setup``)."""
        if self._tokenizer is None:
            raise RuntimeError("TranslationDataModule.tokenizer is available after setup()")
        return self._tokenizer

    @property
    def tokenized(self) -> datasets.DatasetDict:
        """Tokenized splits with columns ``src``, ``tgt``, ``src_ids``, ``tgt_ids``, ``length``
        (available after ``setup``)."""
        if self._datasets is None:
            raise RuntimeError("TranslationDataModule.tokenized is available after setup()")
        return self._datasets

    @property
    def pad_id(self) -> int:
        """Id of ``<pad>``."""
        return self.tokenizer.pad_id

    @property
    def vocab_size(self) -> int:
        """Size of the trained vocabulary (can be below the requested ``vocab_size``)."""
        return self.tokenizer.vocab_size

    def save_tokenizer(self, run_dir: str | Path) -> Path:
        """Write the tokenizer to ``<run_dir>/tokenizer.json`` and return that path."""
        return self.tokenizer.save(Path(run_dir) / "tokenizer.json")

    # ---------------------------------------------------------------------- dataloaders

    def _loader(
        self, dataset: datasets.Dataset, sampler: TokenBucketSampler, bpe_dropout: float = 0.0
    ) -> DataLoader:
        tok = self.tokenizer
        encode = tok.with_bpe_dropout(bpe_dropout).encode_batch if bpe_dropout > 0 else None
        return DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=partial(
                collate, pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id, encode=encode
            ),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    @property
    def train_sampler(self) -> TokenBucketSampler:
        """The resumable training batch sampler (created on first use)."""
        if self._train_sampler is None:
            # Under DDP every rank packs the same global batches of max_tokens * world_size and
            # takes its share of each (Lightning must not wrap it: use_distributed_sampler=False).
            trainer = self.trainer
            sampler = TokenBucketSampler(
                self.tokenized["train"]["length"],
                max_tokens=self.max_tokens,
                shuffle=True,
                seed=self.seed,
                world_size=trainer.world_size if trainer is not None else 1,
                rank=trainer.global_rank if trainer is not None else 0,
            )
            if self._pending_sampler_state is not None:
                sampler.load_state_dict(self._pending_sampler_state)
                self._pending_sampler_state = None
            self._train_sampler = sampler
            self._log_batches("train", self.tokenized["train"], sampler)
        return self._train_sampler

    def _log_batches(self, split: str, ds: datasets.Dataset, sampler: TokenBucketSampler) -> None:
        fraction = real_token_fraction(
            sampler.epoch_batches(sampler.epoch),
            [len(ids) + 1 for ids in ds["src_ids"]],
            [len(ids) + 2 for ids in ds["tgt_ids"]],
        )
        logger.info(
            "%s: %d pairs in %d batches of <= %d tokens; padding is %.1f%% of src+tgt positions",
            split,
            len(ds),
            len(sampler),
            sampler.max_tokens,
            100 * (1 - fraction),
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled, length-bucketed, resumable token-budget batches (BPE-dropout if set)."""
        return self._loader(self.tokenized["train"], self.train_sampler, self.bpe_dropout)

    def _eval_loader(self, split: str) -> DataLoader:
        dataset = self.tokenized[split]
        # Batches come longest first: each example keeps its row, so that outputs can be put
        # back in the split's order (the run's hypotheses.test.txt).
        dataset = dataset.add_column("index", list(range(len(dataset))))
        trainer = self.trainer
        if self.shard_eval and trainer is not None and trainer.world_size > 1:
            # Under DDP rank r decodes examples r, r + W, r + 2W, ...: disjoint shares that
            # together are the split once (the module gathers them for corpus BLEU).
            dataset = dataset.shard(trainer.world_size, trainer.global_rank, contiguous=False)
        sampler = TokenBucketSampler(
            dataset["length"], max_tokens=self.eval_max_tokens, shuffle=False
        )
        self._log_batches(split, dataset, sampler)
        return self._loader(dataset, sampler)

    def val_dataloader(self) -> DataLoader:
        """Validation batches, longest first, in a fixed order."""
        return self._eval_loader("validation")

    def test_dataloader(self) -> DataLoader:
        """Test batches, longest first, in a fixed order."""
        return self._eval_loader("test")

    # -------------------------------------------------------------------------- resuming

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Count training batches the trainer really used (the loader may prefetch more)."""
        trainer = self.trainer
        if trainer is not None and trainer.training and self._train_sampler is not None:
            sampler = self._train_sampler
            if self._consumed_epoch != sampler.epoch:
                self._consumed_epoch, self._consumed = sampler.epoch, sampler.start_batch
            self._consumed += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The training sampler's position, ``{"train_sampler": TokenBucketSampler.state_dict()}``.

        Under a trainer the position counts the batches really used, not those prefetched.
        """
        if self._train_sampler is None:
            pending = self._pending_sampler_state
            return {} if pending is None else {"train_sampler": dict(pending)}
        sampler = self._train_sampler
        consumed = None
        if self.trainer is not None:
            same_epoch = self._consumed_epoch == sampler.epoch
            consumed = self._consumed if same_epoch else sampler.start_batch
        return {"train_sampler": sampler.state_dict(batches_consumed=consumed)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the training sampler from a ``state_dict`` (before or after ``setup``)."""
        state = state_dict.get("train_sampler")
        if state is None:
            return
        self._consumed_epoch = None
        if self._train_sampler is None:
            self._pending_sampler_state = dict(state)
        else:
            self._train_sampler.load_state_dict(state)
