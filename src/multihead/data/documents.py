"""Long documents as windows for a causal language model at long context.

A document (a source file of :mod:`multihead.data.code_corpus`, or a text of a Hub dataset
read by the same loader) is cut into disjoint windows of ``context`` tokens, the first
starting at a random offset in the document, so that a token's position in its window is
the context the model has seen of it, not its place in the file. Documents no longer than
the context give no window. The offsets come from ``data_seed``, the same for every run, so
that every run reads the same windows, in its own ``seed``'s order.

Three splits: ``train``; ``test``, the scored held-out windows (logged as ``val/...``, the
held-out figures of every run); ``validation``, the windows a learning rate is chosen on
(logged as ``select/...``), never scored. Both held-out sets are the same for all runs and
are drawn from every source package (the corpus's ``package`` column, where it has one) in
proportion to its bytes in the corpus (:func:`allocate`); the scored loss is also logged per
package (``val/loss/<package>``).

The tokenizer is the project's byte-level BPE (:class:`~multihead.data.tokenizer.Tokenizer`),
trained on the training documents with ``tokenizers`` and cached by their hash.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from multihead.data.code_corpus import (
    PACKAGES,
    SPLITS,
    VERSION,
    Package,
    build_code_corpus,
    load_code_corpus,
)
from multihead.data.lm import BlockDataModule
from multihead.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# The held-out splits: the one scored (logged as val/) and the one a learning rate is chosen
# on (select/), each with the setting that says how many windows it has.
HELD_OUT = {"test": ("val", "val_windows"), "validation": ("select", "select_windows")}
GROUP_COLUMN = "package"  # the code corpus's source package of each document


def cut_windows(
    documents: list[list[int]], context: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``(N, context)`` windows and ``(N,)`` the index of each one's document: each document
    longer than ``context`` cut into disjoint windows, the first at an offset drawn
    uniformly from those that leave room for one window (at most ``context - 1``); what is
    left at the end is dropped."""
    windows, sources = [], []
    for i, ids in enumerate(documents):
        n = len(ids)
        if n <= context:
            continue
        start = int(rng.integers(0, min(context, n - context) + 1))
        for s in range(start, n - context + 1, context):
            windows.append(ids[s : s + context])
            sources.append(i)
    if not windows:
        raise ValueError(f"no document is longer than context={context} tokens")
    return np.asarray(windows, dtype=np.int64), np.asarray(sources, dtype=np.int64)


def allocate(total: int, weights: Mapping[str, float]) -> dict[str, int]:
    """``total`` split among the groups in proportion to ``weights`` (largest remainders),
    every group at least one."""
    if total < len(weights):
        raise ValueError(f"{total} windows cannot hold one of each of {len(weights)} packages")
    whole = sum(weights.values())
    quota = {g: total * w / whole for g, w in weights.items()}
    counts = {g: max(1, int(q)) for g, q in quota.items()}
    order = sorted(weights, key=lambda g: (int(quota[g]) - quota[g], str(g)))  # remainders
    for i in range(total - sum(counts.values())):
        counts[order[i % len(order)]] += 1
    while sum(counts.values()) > total:  # the ones raised to one came from the others
        counts[max((g for g in counts if counts[g] > 1), key=lambda g: counts[g] - quota[g])] -= 1
    return counts


def bucket_names(edges: list[int], context: int) -> list[str]:
    """``[0, e1), [e1, e2), ... [ek, context)`` as ``"0-63"``, ``"64-255"``, ...: positions of
    the predicted token in its window, i.e. the tokens of context seen before it."""
    bounds = [0, *edges, context]
    return [f"{lo}-{hi - 1}" for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


class DocumentLMDataModule(BlockDataModule):
    """Windows of long documents for a causal LM.

    Args:
        corpus: ``"python-packages-v2"`` (built on first use from pinned wheels,
            :mod:`~multihead.data.code_corpus`) or a Hub dataset's name with ``train``,
            ``validation`` and ``test`` splits (e.g. ``"deepmind/pg19"``), read by the same
            loader.
        text_column: the documents' column.
        context: tokens per window.
        vocab_size: the BPE's size.
        batch_size: windows per batch.
        steps: the updates a run takes (``trainer.max_steps``): more windows than the
            corpus holds are refused, so that no run reads a window twice.
        val_windows: scored held-out windows (of the ``test`` split), from each package in
            proportion to its bytes, each package's the first of a fixed shuffle.
        select_windows: windows of the ``validation`` split, drawn the same way, that a
            learning rate is chosen on (``select/loss``).
        cache_dir: corpus, tokenizer and ``datasets`` files.
        seed: the order of the training windows.
        data_seed: the windows' offsets and the held-out draw (shared by every run).
        packages: ``[{name, version, sha256}, ...]``, the wheels of the built corpus
            (``None``: :data:`~multihead.data.code_corpus.PACKAGES`).
        find_links: a directory of the pinned wheels, to build the corpus offline.

    Batches are ``(B, context)`` long tensors. :attr:`val_sets` names each validation
    loader: the scored windows of each package (``("val", package)``), then the selection
    windows (``("select", None)``).
    """

    def __init__(
        self,
        *,
        corpus: str = VERSION,
        text_column: str = "text",
        context: int = 2048,
        vocab_size: int = 4096,
        batch_size: int = 4,
        steps: int | None = None,
        val_windows: int = 64,
        select_windows: int = 64,
        cache_dir: str | Path = "outputs/cache",
        seed: int = 0,
        data_seed: int = 0,
        packages: list[dict] | None = None,
        find_links: str | None = None,
    ) -> None:
        super().__init__()
        for key, value in (
            ("context", context),
            ("vocab_size", vocab_size),
            ("batch_size", batch_size),
            ("val_windows", val_windows),
            ("select_windows", select_windows),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"data.{key} must be a positive int, got {value!r}")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)):
            raise ValueError(f"data.steps must be an int or null, got {steps!r}")
        self.corpus, self.text_column = corpus, text_column
        self.context, self.vocab_size_setting = context, vocab_size
        self.batch_size, self.steps = batch_size, steps
        self.val_windows, self.select_windows = val_windows, select_windows
        self.cache_dir, self.seed, self.data_seed = Path(cache_dir), seed, data_seed
        self.packages = PACKAGES if packages is None else tuple(Package(**p) for p in packages)
        self.find_links = find_links
        self.tokenizer: Tokenizer | None = None
        self.blocks: dict[str, torch.Tensor] = {}
        self.groups: dict[str, list] = {}  # the package of each held-out window
        self.val_sets: list[tuple[str, str | None]] = []
        self.card: dict = {}

    def _load(self):
        import datasets

        if self.corpus == VERSION:
            root = build_code_corpus(self.cache_dir, self.packages, self.find_links)
            self.card = json.loads((root / "card.json").read_text())
            return load_code_corpus(root, self.cache_dir)
        dataset = datasets.load_dataset(self.corpus, cache_dir=str(self.cache_dir / "hf"))
        missing = set(SPLITS) - set(dataset)
        if missing:
            raise ValueError(
                f"data.corpus={self.corpus!r} has no {sorted(missing)} split; expected "
                f"{', '.join(SPLITS)}, got {sorted(dataset)}"
            )
        self.card = {"version": self.corpus, "fingerprint": dataset["train"]._fingerprint}
        return dataset

    def _tokenizer(self, texts: list[str]) -> Tokenizer:
        settings = {"card": self.card, "vocab_size": self.vocab_size_setting}
        key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
        path = self.cache_dir / "tokenizers" / f"documents-bpe-{self.vocab_size_setting}-{key}.json"
        if path.is_file():
            return Tokenizer.load(path)
        logger.info("training a %d-token BPE on %d documents", self.vocab_size_setting, len(texts))
        tokenizer = Tokenizer.train(texts, vocab_size=self.vocab_size_setting)
        path.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save(path)
        return tokenizer

    def _draw(self, split: str, windows: np.ndarray, groups: np.ndarray, weights) -> np.ndarray:
        """The indices of ``split``'s held-out windows: each group's share of the setting's
        number (:func:`allocate`), the first of a fixed shuffle of that group's windows."""
        key = HELD_OUT[split][1]
        keep = []
        for k, (group, n) in enumerate(sorted(allocate(getattr(self, key), weights).items())):
            mine = np.flatnonzero(groups == group)
            if len(mine) < n:
                raise ValueError(
                    f"the corpus's {split} split has {len(mine)} windows of {group} at "
                    f"context={self.context}, fewer than the {n} of data.{key}="
                    f"{getattr(self, key)} that its share of the corpus's bytes needs"
                )
            order = np.random.default_rng([self.data_seed, SPLITS.index(split), k])
            keep.append(mine[np.sort(order.permutation(len(mine))[:n])])
        return np.sort(np.concatenate(keep))

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is not None:
            return
        dataset = self._load()
        if self.text_column not in dataset["train"].column_names:
            raise ValueError(
                f"data.text_column={self.text_column!r} is not a column of {self.corpus}; "
                f"its columns: {dataset['train'].column_names}"
            )
        self.tokenizer = tok = self._tokenizer(dataset["train"][self.text_column])
        grouped = GROUP_COLUMN in dataset["train"].column_names
        weights: Counter = Counter()  # each package's bytes in the whole corpus
        for split in SPLITS:
            texts = dataset[split][self.text_column]
            names = dataset[split][GROUP_COLUMN] if grouped else [None] * len(texts)
            for text, name in zip(texts, names, strict=True):
                weights[name] += len(text.encode())
        self.stats = {}
        for index, split in enumerate(SPLITS):
            texts = dataset[split][self.text_column]
            ids = tok.encode_batch(texts)
            lengths = np.array([len(i) for i in ids])
            rng = np.random.default_rng([self.data_seed, index])
            windows, sources = cut_windows(ids, self.context, rng)
            names = dataset[split][GROUP_COLUMN] if grouped else [None] * len(texts)
            groups = np.array(names, dtype=object)[sources]  # (N,): each window's package
            if split in HELD_OUT:
                keep = self._draw(split, windows, groups, weights)
                windows, groups = windows[keep], groups[keep]
                self.groups[split] = groups.tolist()
            self.blocks[split] = torch.from_numpy(windows)
            self.stats[split] = {
                "documents": len(ids),
                "documents_longer_than_context": int((lengths > self.context).sum()),
                "tokens": int(lengths.sum()),
                "windows": len(windows),
                "windows_per_package": {str(g): int(n) for g, n in Counter(groups).items()},
                # The package of each held-out window, in the loaders' order within a package.
                **({"window_packages": groups.tolist()} if split in HELD_OUT else {}),
                "length_percentiles": dict(
                    zip(
                        ("p10", "p50", "p90"),
                        np.percentile(lengths, [10, 50, 90]).tolist(),
                        strict=True,
                    )
                ),
            }
        packages = sorted(set(self.groups["test"]), key=str)
        self.val_sets = [("val", g) for g in packages] if grouped else [("val", None)]
        self.val_sets.append(("select", None))
        reads = None if self.steps is None else self.steps * self.batch_size
        if reads is not None and reads > len(self.blocks["train"]):
            raise ValueError(
                f"trainer.max_steps={self.steps} x data.batch_size={self.batch_size} = {reads} "
                f"windows, more than the corpus's {len(self.blocks['train'])} at "
                f"context={self.context}: a run would read windows twice"
            )
        logger.info("document windows: %s", json.dumps(self.stats))

    def scored_windows(self, package: str | None = None) -> torch.Tensor:
        """The scored held-out windows ``(N, context)``, all or one package's."""
        if package is None:
            return self.blocks["test"]
        return self.blocks["test"][[g == package for g in self.groups["test"]]]

    def val_dataloader(self) -> list[DataLoader]:
        """One loader per entry of :attr:`val_sets`: each package's scored windows, then the
        selection windows."""
        held = [self.scored_windows(g) for split, g in self.val_sets if split == "val"]
        sets = [*held, self.blocks["validation"]]
        return [DataLoader(s, batch_size=self.batch_size) for s in sets]
