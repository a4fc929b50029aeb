"""Language-model data: what every causal LM's data module shares (:class:`BlockDataModule`),
and the sentences of a parallel corpus, both languages, as one stream.

Every sentence of a split's ``src`` and ``tgt`` columns becomes ``<bos> ids <eos>``; the
sentences are concatenated in corpus order and cut into blocks of ``block_size`` tokens
(the last, shorter block is dropped), the packing of Hugging Face's ``run_clm`` example.
A block may start inside a sentence and hold several: the model learns to continue across
``<eos>``. The tokenizer is the translation data's joint BPE (:func:`load_or_train_tokenizer`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Sampler

from multihead.data.loading import filter_parallel_dataset, load_parallel_dataset
from multihead.data.resume import CountsTrainingBatches
from multihead.data.tokenizer import Tokenizer, load_or_train_tokenizer


def pack_blocks(sentences: list[list[int]], *, bos_id: int, eos_id: int, block_size: int):
    """``(N, block_size)`` long: ``<bos> s <eos>`` of every sentence, concatenated, cut."""
    stream = list(itertools.chain.from_iterable([bos_id, *s, eos_id] for s in sentences))
    n = len(stream) // block_size
    if n == 0:
        raise ValueError(
            f"block_size={block_size} is longer than the whole split ({len(stream)} tokens)"
        )
    return torch.tensor(stream[: n * block_size]).view(n, block_size)  # (N, block_size)


class BlockOrder(Sampler[list[int]]):
    """Batches of ``batch_size`` block indices (the last of an epoch may be shorter), each
    epoch in a new random order, from batch ``position()`` of the whole training on: a
    resumed run gets the batches an uninterrupted one would (:mod:`multihead.data.resume`).

    The order is that of ``DataLoader(blocks, batch_size, shuffle=True,
    generator=torch.Generator().manual_seed(seed))``, which these runs used before they could
    resume; keeping it keeps the runs recorded then reproducible. Per epoch, that loader
    draws its workers' base seed from the generator, then its ``RandomSampler`` draws the
    order (``randperm``) and, at the epoch's end, a second, empty ``randperm`` (the remainder
    of its ``num_samples // n`` whole permutations).
    """

    def __init__(
        self, num_blocks: int, batch_size: int, seed: int, position: Callable[[], int]
    ) -> None:
        self.num_blocks, self.batch_size, self.seed = num_blocks, batch_size, seed
        self.position = position

    def __len__(self) -> int:
        return -(-self.num_blocks // self.batch_size)  # ceil: the last batch may be short

    def __iter__(self) -> Iterator[list[int]]:
        epoch, start = divmod(self.position(), len(self))
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(epoch + 1):  # the epochs before this one, to their generator state
            torch.empty((), dtype=torch.int64).random_(generator=generator)  # the base seed
            order = torch.randperm(self.num_blocks, generator=generator)  # (N,)
            torch.randperm(self.num_blocks, generator=generator)  # the empty remainder
        for batch in order.split(self.batch_size)[start:]:
            yield batch.tolist()


class BlockDataModule(CountsTrainingBatches, L.LightningDataModule):
    """What every causal LM's data shares: ``(N, T)`` blocks per split in :attr:`blocks`
    (filled by a subclass's ``setup``), batched as ``(B, T)`` long tensors, the training
    split shuffled by ``seed`` (:class:`BlockOrder`, resumable); the tokenizer, its size and
    padding id, saved beside a run."""

    tokenizer: Tokenizer | None
    blocks: dict[str, torch.Tensor]
    batch_size: int
    seed: int

    @property
    def vocab_size(self) -> int:
        """The tokenizer's ids, special tokens included (after :meth:`setup`)."""
        return self.tokenizer.vocab_size

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    def save_tokenizer(self, run_dir: str | Path) -> None:
        """The tokenizer as ``<run_dir>/tokenizer.json``."""
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(Path(run_dir) / "tokenizer.json")

    def train_dataloader(self) -> DataLoader:
        order = BlockOrder(
            len(self.blocks["train"]), self.batch_size, self.seed, lambda: self.batches_used
        )
        # The loader draws its workers' base seed from a generator of its own, which leaves
        # the global one alone, as before.
        return DataLoader(self.blocks["train"], batch_sampler=order, generator=torch.Generator())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.blocks["validation"], batch_size=self.batch_size)


class LanguageModelDataModule(BlockDataModule):
    """Blocks of both languages' sentences of a parallel corpus, for a causal LM.

    Args:
        name, src_lang, tgt_lang, local_dir: the corpus, as :func:`load_parallel_dataset`.
        vocab_size: the joint BPE's size.
        block_size: tokens per training example.
        batch_size: blocks per batch.
        cache_dir: where the tokenizer is cached.
        seed: the order of the training blocks.

    Batches are ``(B, block_size)`` long tensors; the model predicts each next token.
    """

    def __init__(
        self,
        *,
        name: str = "bentrevett/multi30k",
        src_lang: str = "en",
        tgt_lang: str = "de",
        local_dir: str | None = None,
        vocab_size: int = 8000,
        block_size: int = 128,
        batch_size: int = 16,
        cache_dir: str | Path = "outputs/cache",
        seed: int = 0,
    ) -> None:
        super().__init__()
        for key, value in (("block_size", block_size), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        self.corpus = dict(name=name, src_lang=src_lang, tgt_lang=tgt_lang, local_dir=local_dir)
        self.vocab_size_setting = vocab_size
        self.block_size = block_size
        self.batch_size = batch_size
        self.cache_dir = cache_dir
        self.seed = seed
        self.tokenizer: Tokenizer | None = None
        self.blocks: dict[str, torch.Tensor] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is not None:
            return
        dataset, _ = filter_parallel_dataset(load_parallel_dataset(**self.corpus))
        self.tokenizer = load_or_train_tokenizer(dataset, self.cache_dir, self.vocab_size_setting)
        tok = self.tokenizer
        for split in ("train", "validation"):
            ds = dataset[split]
            sentences = tok.encode_batch(list(ds["src"]) + list(ds["tgt"]))
            self.blocks[split] = pack_blocks(
                sentences, bos_id=tok.bos_id, eos_id=tok.eos_id, block_size=self.block_size
            )
