"""Token-budget batching: a resumable length-bucketing batch sampler and the collate function."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Sampler

logger = logging.getLogger(__name__)


def pack_batches(order: Sequence[int], lengths: np.ndarray, max_tokens: int) -> list[list[int]]:
    """Greedily cut ``order`` into consecutive batches whose padded cost fits ``max_tokens``.

    The cost of a batch is ``len(batch) * max(lengths[batch])``: padding counts. An example
    longer than ``max_tokens`` on its own becomes a batch of one.
    """
    batches: list[list[int]] = []
    batch: list[int] = []
    longest = 0
    for index in order:
        length = int(lengths[index])
        new_longest = max(longest, length)
        if batch and (len(batch) + 1) * new_longest > max_tokens:
            batches.append(batch)
            batch, new_longest = [], length
        batch.append(int(index))
        longest = new_longest
    if batch:
        batches.append(batch)
    return batches


def batches_by_length(lengths: Sequence[int], batch_size: int) -> Iterator[list[int]]:
    """Indices of ``lengths`` sorted by length (stable), in consecutive groups of
    ``batch_size``: decoding batches of similar lengths, so little is spent on padding."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


def shard_batch(batch: Sequence[int], *, rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s share of a global batch split between ``world_size`` ranks.

    The batch is cut into ``world_size`` consecutive parts whose sizes differ by at most one
    (the first ``len(batch) % world_size`` parts have the extra example), so the parts joined
    in rank order give back the batch. A batch with fewer examples than ranks cannot give
    every rank its own: rank ``r`` then gets ``[batch[r % len(batch)]]``, repeating examples,
    because under DDP every rank must take the step.
    """
    n = len(batch)
    if n < world_size:
        return [int(batch[rank % n])]
    size, extra = divmod(n, world_size)
    start = rank * size + min(rank, extra)
    return [int(i) for i in batch[start : start + size + (rank < extra)]]


class TokenBucketSampler(Sampler[list[int]]):
    """Yields lists of dataset indices whose padded token count stays within ``max_tokens``.

    Training (``shuffle=True``): each epoch the indices are shuffled with a generator seeded by
    ``(seed, epoch)``, then stably sorted by length, so examples of equal length are mixed
    randomly while the padding stays minimal; the sorted run is cut into batches and the batch
    order is shuffled. Since the sorted length sequence is the same every epoch, so are the
    batch sizes and the number of batches (``len`` never changes; Lightning reads it once).

    Evaluation (``shuffle=False``): indices sorted by decreasing length (the largest batch comes
    first, so memory problems show at once), always in the same order.

    Each call to ``iter`` starts the next epoch, unless ``set_epoch`` or ``load_state_dict``
    was called since the previous one. ``state_dict`` records the epoch and how many of its
    batches were used, and ``load_state_dict`` makes the next ``iter`` yield exactly the
    remaining batches of that epoch.

    Distributed training (``world_size > 1``): every rank packs the same *global* batches with
    the budget ``max_tokens * world_size`` (same ``seed``, so the same shuffle on every rank)
    and takes its share of each with :func:`shard_batch`. So step ``i`` of the ``world_size``
    ranks together covers exactly the batch of step ``i`` of one process with
    ``max_tokens * world_size``, every rank has ``len(self)`` steps per epoch (nothing to drop
    or pad), and every example is in one rank's batch once per epoch (except in a global batch
    smaller than ``world_size``, see :func:`shard_batch`). A share's padded cost can exceed
    ``max_tokens`` by less than the length of its longest example, since only the global batch
    is packed to the budget. The rank and world size come from these arguments only (the
    DataModule passes the trainer's), never from ``torch.distributed``; run Lightning with
    ``use_distributed_sampler=False`` so that it leaves this sampler alone. The state is the
    same on every rank, so the one saved by rank 0 resumes them all.

    Args:
        lengths: Cost of each example in tokens (max of source and target, specials included).
        max_tokens: Budget of ``num_sentences * longest_length`` per batch of one rank.
        shuffle: Shuffle for training; ``False`` gives the deterministic evaluation order.
        seed: Base seed; epoch ``e`` uses the generator seeded with ``(seed, e)``.
        world_size: Number of ranks sharing each global batch.
        rank: This process's rank, in ``[0, world_size)``.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        max_tokens: int,
        shuffle: bool = True,
        seed: int = 0,
        world_size: int = 1,
        rank: int = 0,
    ) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1 or len(self.lengths) == 0:
            raise ValueError(
                f"lengths must be a non-empty 1-D sequence, got shape {self.lengths.shape}"
            )
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens}")
        if world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.max_tokens = max_tokens
        self.shuffle = shuffle
        self.seed = seed
        self.world_size = world_size
        self.rank = rank
        too_long = int((self.lengths > max_tokens).sum())
        if too_long:
            logger.warning(
                "%d examples are longer than max_tokens=%d (longest %d); their batches exceed it",
                too_long,
                max_tokens,
                int(self.lengths.max()),
            )
        self._num_batches = len(self.epoch_batches(0))
        self._epoch = 0
        self._start = 0  # batches of self._epoch to skip on the next iter
        self._yielded = 0  # batches of self._epoch handed out so far (skipped ones included)
        self._fresh = True  # the next iter uses self._epoch as it is

    @property
    def epoch(self) -> int:
        """The epoch of the current (or, before the first ``iter``, next) pass."""
        return self._epoch

    @property
    def start_batch(self) -> int:
        """Number of this epoch's batches skipped because they were used before a resume."""
        return self._start

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter`` produce epoch ``epoch`` (from where a loaded state left it)."""
        if epoch != self._epoch or not self._fresh:
            self._start = 0
        self._epoch = epoch
        self._yielded = self._start
        self._fresh = True

    @property
    def global_max_tokens(self) -> int:
        """Budget of a global batch, the one all ranks share: ``max_tokens * world_size``."""
        return self.max_tokens * self.world_size

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of ``epoch`` in the order ``iter`` yields them (no state change)."""
        if not self.shuffle:
            order = np.argsort(-self.lengths, kind="stable")
            batches = pack_batches(order, self.lengths, self.global_max_tokens)
        else:
            rng = np.random.default_rng((self.seed, epoch))
            perm = rng.permutation(len(self.lengths))
            order = perm[np.argsort(self.lengths[perm], kind="stable")]
            batches = pack_batches(order, self.lengths, self.global_max_tokens)
            batches = [batches[i] for i in rng.permutation(len(batches))]
        if self.world_size == 1:
            return batches
        return [shard_batch(b, rank=self.rank, world_size=self.world_size) for b in batches]

    def __len__(self) -> int:
        return self._num_batches

    def __iter__(self) -> Iterator[list[int]]:
        if not self._fresh:
            self._epoch += 1
            self._start = 0
        self._fresh = False
        self._yielded = self._start
        return self._generate(self.epoch_batches(self._epoch), self._start)

    def _generate(self, batches: list[list[int]], start: int) -> Iterator[list[int]]:
        for batch in batches[start:]:
            self._yielded += 1
            yield batch

    def state_dict(self, batches_consumed: int | None = None) -> dict[str, int]:
        """The position to resume from.

        Args:
            batches_consumed: Batches of the current epoch the consumer has really used.
                Defaults to the number yielded, which overcounts when a ``DataLoader`` or a
                trainer prefetches batches.

        Returns:
            ``epoch``, ``batches_yielded`` (batches of that epoch already used), ``seed``,
            ``num_examples`` and ``global_max_tokens``; the same on every rank. A finished
            epoch is stored as the start of the next one.
        """
        done = self._yielded if batches_consumed is None else batches_consumed
        epoch = self._epoch
        if done >= self._num_batches:
            epoch, done = epoch + 1, 0
        return {
            "epoch": epoch,
            "batches_yielded": done,
            "seed": self.seed,
            "num_examples": len(self.lengths),
            "global_max_tokens": self.global_max_tokens,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume from ``state``: the next ``iter`` yields the remaining batches of its epoch.

        The global batches depend only on the data, the seed and ``global_max_tokens``, so a
        state can be loaded on any rank, and by a run with another world size whose
        ``max_tokens * world_size`` is the same. Keys missing from ``state`` are not checked.

        Raises:
            ValueError: ``state`` was saved for another seed, dataset size or global batch
                budget, or its position is out of range.
        """
        for key, mine in (
            ("seed", self.seed),
            ("num_examples", len(self.lengths)),
            ("global_max_tokens", self.global_max_tokens),
        ):
            if state.get(key, mine) != mine:
                raise ValueError(
                    f"sampler state has {key}={state[key]} but this sampler has {key}={mine}; "
                    "resume with the same data, seed and max_tokens * world_size"
                )
        start = int(state["batches_yielded"])
        if not 0 <= start <= self._num_batches:
            raise ValueError(
                f"batches_yielded={start} is outside [0, {self._num_batches}] for this sampler"
            )
        self._epoch = int(state["epoch"])
        self._start = start
        self._yielded = start
        self._fresh = True


def real_token_fraction(
    batches: Sequence[Sequence[int]], src_lengths: Sequence[int], tgt_lengths: Sequence[int]
) -> float:
    """Real tokens / padded positions of ``src`` and ``tgt`` over ``batches``.

    Lengths include the special tokens (``+1`` for the source, ``+2`` for the target), so the
    result matches the mean of ``collate``'s ``real_token_fraction`` weighted by batch size.
    """
    src, tgt = np.asarray(src_lengths), np.asarray(tgt_lengths)
    real = padded = 0
    for batch in batches:
        index = np.asarray(batch)
        real += int(src[index].sum() + tgt[index].sum())
        padded += len(index) * int(src[index].max() + tgt[index].max())
    return real / padded


def collate(
    examples: Sequence[Mapping[str, Any]],
    *,
    pad_id: int,
    bos_id: int,
    eos_id: int,
    encode: Callable[[list[str]], list[list[int]]] | None = None,
) -> dict[str, Any]:
    """Pad a list of tokenized examples into a batch.

    Each example has ``src_ids``/``tgt_ids`` (subword ids without specials) and ``src``/``tgt``
    (raw text), and evaluation examples an ``index`` (their row in the split); other keys are
    ignored. With ``encode`` (texts to subword ids, e.g. a
    BPE-dropout tokenizer's ``encode_batch``) the ids come from encoding ``src``/``tgt`` anew
    instead of from ``src_ids``/``tgt_ids``.

    Returns:
        ``src``: (B, S) long, ``src_ids + [eos]`` right-padded with ``pad_id``.
        ``tgt``: (B, T) long, ``[bos] + tgt_ids + [eos]`` right-padded with ``pad_id``.
        ``src_text``, ``tgt_text``: lists of the B raw strings.
        ``real_token_fraction``: float, non-pad positions / all positions of ``src`` and ``tgt``.
        ``index``: list of the B rows in the split, when the examples have one.
    """
    if not examples:
        raise ValueError("collate got an empty list of examples; expected at least one")
    if encode is None:
        src_ids = [ex["src_ids"] for ex in examples]
        tgt_ids = [ex["tgt_ids"] for ex in examples]
    else:
        src_ids = encode([ex["src"] for ex in examples])
        tgt_ids = encode([ex["tgt"] for ex in examples])
    src_rows = [list(ids) + [eos_id] for ids in src_ids]
    tgt_rows = [[bos_id, *ids, eos_id] for ids in tgt_ids]
    src, tgt = (
        pad_sequence([torch.tensor(r) for r in rows], batch_first=True, padding_value=pad_id)
        for rows in (src_rows, tgt_rows)
    )
    real = sum(map(len, src_rows)) + sum(map(len, tgt_rows))
    batch = {
        "src": src,
        "tgt": tgt,
        "src_text": [ex["src"] for ex in examples],
        "tgt_text": [ex["tgt"] for ex in examples],
        "real_token_fraction": real / (src.numel() + tgt.numel()),
    }
    if "index" in examples[0]:
        batch["index"] = [ex["index"] for ex in examples]
    return batch


def example_length(num_src_ids: int, num_tgt_ids: int) -> int:
    """Sampler cost of one example: ``max(len(src) + 1, len(tgt) + 2)``.

    The source gets ``<eos>``, the target ``<bos>`` and ``<eos>`` (see :func:`collate`).
    """
    return max(num_src_ids + 1, num_tgt_ids + 2)
