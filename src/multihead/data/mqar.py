"""Multi-query associative recall (MQAR, Arora et al. 2023, "Zoology"): the recall probe.

A sequence of ``seq_len`` tokens opens with ``num_kv_pairs`` key-value pairs
``k1 v1 k2 v2 ...`` (keys from the first half of the vocabulary, values from the second,
each drawn without replacement within a sequence). Every key then appears once more as a
query, at an even offset of the rest of the sequence; the offsets are drawn without
replacement with probabilities following a power law (``a * x^(a-1)``, ``a = power_a``), so
most queries come soon after the pairs and some much later. Every other position holds a
random token. The model must predict, at each query, the value that was paired with its key:
``labels`` holds that value at the query's position and ``-100`` (ignored) everywhere else.
This follows Zoology's ``multiquery_ar`` generator (``zoology/data/multiquery_ar.py``,
github.com/HazyResearch/zoology).
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from multihead.data.resume import CountsTrainingBatches

IGNORE = -100


def multiquery_ar(
    num_examples: int,
    seq_len: int,
    num_kv_pairs: int,
    vocab_size: int,
    generator: torch.Generator,
    power_a: float = 0.01,
) -> tuple[Tensor, Tensor]:
    """``(inputs, labels)``, both ``(num_examples, seq_len)`` long; see the module docstring."""
    if seq_len % 2 or num_kv_pairs * 4 > seq_len:
        raise ValueError(
            f"MQAR needs an even seq_len >= 4 * num_kv_pairs, got seq_len={seq_len}, "
            f"num_kv_pairs={num_kv_pairs}"
        )
    if vocab_size <= seq_len or vocab_size // 2 <= num_kv_pairs:
        raise ValueError(f"vocab_size={vocab_size} must exceed seq_len={seq_len}")
    N, P, half = num_examples, num_kv_pairs, vocab_size // 2
    # Keys from 1 .. V/2 - 1, values from V/2 .. V - 1, distinct within a sequence.
    keys = torch.rand(N, half - 1, generator=generator).argsort(dim=1)[:, :P] + 1  # (N, P)
    values = torch.rand(N, vocab_size - half, generator=generator).argsort(dim=1)[:, :P] + half
    context = 2 * P
    pairs = torch.stack([keys, values], dim=2).flatten(1)  # (N, 2P): k1 v1 k2 v2 ...
    # The queries' even offsets after the pairs, power-law distributed, no offset twice.
    space = (seq_len - context) // 2
    x = torch.arange(1, space + 1, dtype=torch.float64)
    p = power_a * x ** (power_a - 1)
    gaps = torch.multinomial(p.expand(N, space), P, replacement=False, generator=generator)
    rest = torch.randint(0, vocab_size, (N, seq_len - context), generator=generator)
    rest.scatter_(1, 2 * gaps, keys)  # (N, L - 2P): each key once more, as a query
    inputs = torch.cat([pairs, rest], dim=1)  # (N, L)
    labels = torch.full((N, seq_len), IGNORE, dtype=torch.long)
    labels.scatter_(1, context + 2 * gaps, values)  # at the query: its key's value
    return inputs, labels


class _Batches(IterableDataset):
    """Fresh training batches, one (seq_len, pairs) setting after another, from one seed,
    from batch ``position()`` on (the batches before it are drawn and dropped, which puts
    the generator where an uninterrupted run has it)."""

    def __init__(
        self, settings, batch_tokens: int, vocab_size: int, seed: int, position: Callable[[], int]
    ) -> None:
        self.settings, self.batch_tokens = settings, batch_tokens
        self.vocab_size, self.seed, self.position = vocab_size, seed, position

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed)
        start, step = self.position(), 0
        while True:
            seq_len, pairs = self.settings[step % len(self.settings)]
            n = max(1, self.batch_tokens // seq_len)
            inputs, labels = multiquery_ar(n, seq_len, pairs, self.vocab_size, generator)
            if step >= start:
                yield {"input_ids": inputs, "labels": labels}
            step += 1


class MQARDataModule(CountsTrainingBatches, L.LightningDataModule):
    """MQAR for training from scratch and a grid of held-out settings.

    Args:
        train_settings: ``[[seq_len, num_kv_pairs], ...]`` trained on in turn, one per batch.
        eval_settings: the grid reported, each its own validation set.
        vocab_size: keys and values share it (Zoology: 8,192).
        batch_tokens: tokens per training batch (``batch_tokens // seq_len`` sequences).
        eval_examples: scored held-out sequences per setting (``val/acc@SEQxPAIRS``).
        select_examples: sequences per setting that a learning rate is chosen on
            (``select/loss``, ``select/acc@SEQxPAIRS``), never scored.
        seed: the training sequences. The held-out ones come from fixed seeds, the same for
            every run: setting ``i``'s scored ones from ``10_000 + i``, its selection ones
            from ``20_000 + i`` (a run's ``seed`` must be neither).

    :attr:`val_sets` names the validation loaders: ``("val", "SEQxPAIRS")`` per setting,
    then ``("select", "SEQxPAIRS")`` per setting.
    """

    SEEDS = {"val": 10_000, "select": 20_000}  # + the setting's index

    def __init__(
        self,
        *,
        train_settings: list[list[int]],
        eval_settings: list[list[int]],
        vocab_size: int = 8192,
        batch_tokens: int = 16384,
        eval_examples: int = 256,
        select_examples: int = 128,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for key, value in (("eval_examples", eval_examples), ("select_examples", select_examples)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"data.{key} must be a positive int, got {value!r}")
        self.train_settings = [tuple(s) for s in train_settings]
        self.eval_settings = [tuple(s) for s in eval_settings]
        for seq_len, pairs in self.train_settings + self.eval_settings:
            multiquery_ar(1, seq_len, pairs, vocab_size, torch.Generator())  # checks the values
        self.vocab_size, self.pad_id = vocab_size, 0
        self.batch_tokens, self.seed = batch_tokens, seed
        self.examples = {"val": eval_examples, "select": select_examples}
        self.tokenizer = None
        names = [f"{s}x{p}" for s, p in self.eval_settings]
        self.val_sets = [(split, name) for split in self.SEEDS for name in names]

    def setup(self, stage: str | None = None) -> None:
        self.eval_sets = []
        for split, first_seed in self.SEEDS.items():
            for i, (seq_len, pairs) in enumerate(self.eval_settings):
                generator = torch.Generator().manual_seed(first_seed + i)
                inputs, labels = multiquery_ar(
                    self.examples[split], seq_len, pairs, self.vocab_size, generator
                )
                self.eval_sets.append([{"input_ids": x, "labels": y} for x, y in zip(
                    inputs.split(64), labels.split(64), strict=True)])  # fmt: skip

    def save_tokenizer(self, run_dir) -> None:
        """MQAR's tokens are their ids: there is no tokenizer to save."""

    def train_dataloader(self) -> DataLoader:
        batches = _Batches(
            self.train_settings, self.batch_tokens, self.vocab_size, self.seed,
            lambda: self.batches_used,
        )  # fmt: skip
        return DataLoader(batches, batch_size=None)

    def val_dataloader(self) -> list[DataLoader]:
        return [DataLoader(s, batch_size=None) for s in self.eval_sets]
