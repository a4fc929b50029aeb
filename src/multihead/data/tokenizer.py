"""A joint byte-level BPE vocabulary over source and target text.

Byte-level BPE (ByteLevel pre-tokenizer without a prefix space, ByteLevel decoder, no
normalizer) maps any string to tokens and back to exactly the same string, so decoded model
output is real detokenized text that sacreBLEU can score against raw references.

With ``lowercase=True`` the tokenizer's normalizer is ``normalizers.Lowercase()``: encoding
lowercases every text (training data, sources, references), so the round trip is exact up to
case and decoded output is lowercase. The normalizer is part of the tokenizer's JSON, which
the run directory and every checkpoint hold, so whatever loads the tokenizer (translation,
evaluation, export) lowercases its input the same way.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import datasets
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from multihead.data.loading import content_hash

logger = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3
_CACHE_VERSION = "bytelevel-bpe-v1"
MIN_FREQUENCY = 2  # the fewest occurrences of a pair that BPE merges


def is_dropout_probability(p: object) -> bool:
    """Whether ``p`` is a number in ``[0, 1)``, a valid BPE-dropout (bools are not numbers here)."""
    return not isinstance(p, bool) and isinstance(p, (int, float)) and 0.0 <= p < 1.0


class Tokenizer:
    """Wraps a ``tokenizers.Tokenizer`` holding a byte-level BPE with fixed special ids.

    ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3. ``encode`` returns subword ids
    without special tokens; callers add ``<bos>``/``<eos>`` where they need them.

    Args:
        hf_tokenizer: A trained tokenizer whose first four ids are the special tokens.

    Raises:
        ValueError: The special tokens are not at ids 0 to 3.
    """

    # The ids of SPECIAL_TOKENS (checked in __init__); byte-level BPE never produces <unk>.
    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3

    def __init__(self, hf_tokenizer: HFTokenizer) -> None:
        for expected_id, token in enumerate(SPECIAL_TOKENS):
            actual = hf_tokenizer.token_to_id(token)
            if actual != expected_id:
                raise ValueError(
                    f"special token {token!r} has id {actual}; expected {expected_id} "
                    f"(special tokens must be {SPECIAL_TOKENS} at ids 0-3)"
                )
        # Text such as "<eos>" in a sentence is encoded as ordinary bytes, never as the special
        # token, so that every string round-trips exactly (up to case with a Lowercase
        # normalizer).
        hf_tokenizer.encode_special_tokens = True
        self._hf = hf_tokenizer

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        min_frequency: int = MIN_FREQUENCY,
        lowercase: bool = False,
    ) -> Tokenizer:
        """Train a byte-level BPE on ``texts``.

        Args:
            texts: Training sentences; pass source and target together for a joint vocabulary.
            vocab_size: Target vocabulary size, special tokens and the 256 byte symbols included.
            min_frequency: Minimum count for a pair to be merged.
            lowercase: Give the tokenizer a ``Lowercase`` normalizer, so that it is trained on
                and encodes lowercased text.
        """
        minimum = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
        if vocab_size < minimum:
            raise ValueError(
                f"vocab_size must be at least {minimum} (4 special tokens + 256 bytes), "
                f"got {vocab_size}"
            )
        if min_frequency < 1:
            raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
        if not isinstance(lowercase, bool):
            raise ValueError(f"lowercase must be a bool, got {lowercase!r}")
        hf = HFTokenizer(models.BPE(unk_token=UNK))
        if lowercase:
            # Set before training: the trainer counts pairs in normalized text.
            hf.normalizer = normalizers.Lowercase()
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        texts = iter(texts)
        batches = iter(lambda: list(itertools.islice(texts, 1000)), [])  # lists of 1000 texts
        hf.train_from_iterator(batches, trainer=trainer)
        return cls(hf)

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included."""
        return self._hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Subword ids of ``text``, without ``<bos>``/``<eos>``."""
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Subword ids of each text, encoded in parallel by the Rust tokenizer."""
        encodings = self._hf.encode_batch_fast(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def with_bpe_dropout(self, p: float) -> Tokenizer:
        """A copy that skips each BPE merge with probability ``p`` (BPE-dropout).

        BPE-dropout (Provilkov et al., 2020) is a regulariser for training data: each encoding
        of a word may stop merging early, so the model sees many segmentations of it. It is
        the ``dropout`` of ``tokenizers``' BPE model; its random draws are not seeded, so two
        encodings of the same text differ from run to run. ``p=0`` gives the usual, fully
        merged segmentation. With ``p > 0`` encodings are mostly longer, not always: BPE merges
        greedily, so a skipped merge can rarely lead to fewer pieces (about 1 sentence in 10^4
        of Multi30k at ``p=0.3``). This tokenizer is unchanged; save and decode with it.

        Raises:
            ValueError: ``p`` is not in ``[0, 1)``.
        """
        if not is_dropout_probability(p):
            raise ValueError(f"BPE dropout must be a probability in [0, 1), got {p!r}")
        copy = HFTokenizer.from_str(self._hf.to_str())
        copy.model.dropout = float(p) if p > 0 else None
        return Tokenizer(copy)

    def _strip(self, ids: Iterable[int]) -> list[int]:
        ids = itertools.takewhile(lambda i: i != self.eos_id, map(int, ids))
        return [i for i in ids if i not in (self.pad_id, self.bos_id)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``: stops at the first ``<eos>``, skips ``<pad>`` and ``<bos>``.

        Accepts a list or a 1-D tensor of ids.
        """
        return self._hf.decode(self._strip(ids), skip_special_tokens=True)

    def decode_batch(self, batch: Iterable[Iterable[int]]) -> list[str]:
        """``decode`` applied to every row of ``batch`` (a list of lists or a 2-D tensor)."""
        return self._hf.decode_batch([self._strip(ids) for ids in batch], skip_special_tokens=True)

    def save(self, path: str | Path) -> Path:
        """Write the tokenizer as JSON to ``path`` (atomically) and return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        self._hf.save(str(tmp))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Read a tokenizer written by :meth:`save`.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ValueError: ``path`` is not a tokenizer JSON file with the expected special tokens.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        return cls._parse(HFTokenizer.from_file, str(path), f"{path} is not a tokenizers JSON file")

    def to_str(self) -> str:
        """The tokenizer as a JSON string (stored inside checkpoints)."""
        return self._hf.to_str()

    @classmethod
    def from_str(cls, text: str) -> Tokenizer:
        """Rebuild a tokenizer from :meth:`to_str`'s JSON string."""
        return cls._parse(HFTokenizer.from_str, text, "not a tokenizers JSON string")

    @classmethod
    def _parse(cls, parse: Callable[[str], HFTokenizer], source: str, what: str) -> Tokenizer:
        try:
            hf = parse(source)
        except Exception as exc:  # the Rust side raises a bare Exception on bad JSON
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(f"{what}: {first}") from None
        return cls(hf)

    def fingerprint(self) -> str:
        """A SHA-256 of the serialized tokenizer, for cache keys."""
        return hashlib.sha256(self._hf.to_str().encode("utf-8")).hexdigest()


def load_or_train_tokenizer(
    dataset: datasets.DatasetDict,
    cache_dir: str | Path,
    vocab_size: int,
    lowercase: bool = False,
) -> Tokenizer:
    """Load a cached joint BPE for the ``train`` split, training and caching it on a miss.

    The cache key hashes the split's ``src``/``tgt`` text and the settings, so a change in the
    data, the filter, the limit, the vocabulary size or ``lowercase`` trains a new tokenizer.

    Args:
        dataset: Splits with ``src`` and ``tgt`` columns.
        cache_dir: Directory for cached tokenizers (``<cache_dir>/tokenizers/``).
        vocab_size: Target vocabulary size.
        lowercase: Train and encode lowercased text (see :meth:`Tokenizer.train`).
    """
    split = "train"
    if split not in dataset:
        raise ValueError(f"split {split!r} not in dataset; available: {list(dataset)}")
    if not isinstance(lowercase, bool):
        raise ValueError(f"lowercase must be a bool, got {lowercase!r}")
    settings = {
        "version": _CACHE_VERSION,
        "data": content_hash(dataset[split]),
        "vocab_size": vocab_size,
        "min_frequency": MIN_FREQUENCY,
    }
    if lowercase:  # only then, so that cased tokenizers cached before this option still hit
        settings["lowercase"] = True
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) / "tokenizers" / f"bpe-{vocab_size}-{key}.json"
    if path.is_file():
        logger.info("loading cached tokenizer %s", path)
        return Tokenizer.load(path)
    ds = dataset[split]
    logger.info("training a %d-token joint BPE on %d %s pairs", vocab_size, len(ds), split)
    tokenizer = Tokenizer.train(
        itertools.chain.from_iterable(zip(ds["src"], ds["tgt"], strict=True)),  # src, tgt, ...
        vocab_size=vocab_size,
        min_frequency=MIN_FREQUENCY,
        lowercase=lowercase,
    )
    tokenizer.save(path)
    logger.info("saved tokenizer (%d ids) to %s", tokenizer.vocab_size, path)
    return tokenizer
