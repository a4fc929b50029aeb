from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch

from multihead.data import Tokenizer, load_or_train_tokenizer
from multihead.data import tokenizer as tokenizer_module
from multihead.data.loading import FEATURES


def test_special_ids(multi30k_tokenizer: Tokenizer) -> None:
    tok = multi30k_tokenizer
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.vocab_size == 8000


def test_round_trip_whole_corpus(
    multi30k: datasets.DatasetDict, multi30k_tokenizer: Tokenizer
) -> None:
    texts = [text for ds in multi30k.values() for col in ("src", "tgt") for text in ds[col]]
    ids = multi30k_tokenizer.encode_batch(texts)
    assert multi30k_tokenizer.decode_batch(ids) == texts
    assert all(multi30k_tokenizer.unk_id not in row for row in ids)


@pytest.mark.parametrize(
    "text",
    [
        "",
        " leading and trailing ",
        "two  spaces\ttab",
        "ünïcødé 日本語 🙂",
        "<eos> <pad> literal",
        "\u2028x",
    ],
)
def test_round_trip_edge_cases(multi30k_tokenizer: Tokenizer, text: str) -> None:
    ids = multi30k_tokenizer.encode(text)
    assert not {0, 1, 2, 3} & set(ids)
    assert multi30k_tokenizer.decode(ids) == text
    assert multi30k_tokenizer.encode_batch([text]) == [ids]


def test_decode_stops_at_eos(multi30k_tokenizer: Tokenizer) -> None:
    tok = multi30k_tokenizer
    ids = tok.encode("A dog runs.")
    other = tok.encode(" garbage")
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, *other]) == "A dog runs."
    row = torch.tensor([tok.bos_id, *ids, tok.eos_id, tok.pad_id, tok.pad_id])
    assert tok.decode_batch(torch.stack([row, row])) == ["A dog runs."] * 2


def test_bpe_dropout_varies_the_segmentation_not_the_text(
    multi30k: datasets.DatasetDict, multi30k_tokenizer: Tokenizer
) -> None:
    tok = multi30k_tokenizer
    before = tok.fingerprint()
    texts = multi30k["train"]["tgt"][:500]
    usual = tok.encode_batch(texts)
    assert tok.with_bpe_dropout(0.0).encode_batch(texts) == usual
    drop = tok.with_bpe_dropout(0.5)
    first, second = drop.encode_batch(texts), drop.encode_batch(texts)
    assert tok.decode_batch(first) == tok.decode_batch(second) == texts  # the raw text
    assert all(not {0, 1, 2, 3} & set(row) for row in first)
    # Mostly longer, not always: greedy BPE is not length-optimal, so a skipped merge can
    # rarely open a shorter path. The total is the robust measure.
    assert sum(len(d) > len(u) for d, u in zip(first, usual, strict=True)) > 0.9 * len(texts)
    assert sum(map(len, first)) > 1.5 * sum(map(len, usual))
    assert first != second  # drawn anew on every call
    assert tok.fingerprint() == before and tok.encode_batch(texts) == usual  # tok unchanged


@pytest.mark.parametrize("p", [-0.1, 1.0, 2, "0.1", None, True])
def test_bpe_dropout_must_be_a_probability(multi30k_tokenizer: Tokenizer, p: object) -> None:
    with pytest.raises(ValueError, match=r"^BPE dropout must be a probability in \[0, 1\), got "):
        multi30k_tokenizer.with_bpe_dropout(p)


def test_save_load(tmp_path: Path, multi30k_tokenizer: Tokenizer) -> None:
    path = multi30k_tokenizer.save(tmp_path / "sub" / "tok.json")
    loaded = Tokenizer.load(path)
    text = "Ein Mann mit einem roten Hut."
    assert loaded.encode(text) == multi30k_tokenizer.encode(text)
    assert loaded.fingerprint() == multi30k_tokenizer.fingerprint()


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer file not found: .*missing.json"):
        Tokenizer.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    with pytest.raises(ValueError, match="bad.json is not a tokenizers JSON file"):
        Tokenizer.load(bad)


def test_train_argument_errors() -> None:
    with pytest.raises(ValueError, match="vocab_size must be at least 260.*got 100"):
        Tokenizer.train(["a"], vocab_size=100)
    with pytest.raises(ValueError, match="lowercase must be a bool, got 'yes'"):
        Tokenizer.train(["a"], vocab_size=300, lowercase="yes")


def merged_with_upper(tok: Tokenizer) -> list[str]:
    """The merged tokens (ids after the 4 specials and the 256 bytes) that have uppercase."""
    merged = (tok.decode([i]) for i in range(4 + 256, tok.vocab_size))
    return [piece for piece in merged if piece != piece.lower()]


SENTENCES = ["A Man rides a Horse.", "a man rides a horse.", "Ein Mann reitet ein Pferd."] * 20


def test_lowercase_encodes_case_variants_alike() -> None:
    lower = Tokenizer.train(SENTENCES, vocab_size=300, lowercase=True)
    cased = Tokenizer.train(SENTENCES, vocab_size=300)
    assert lower.encode("A Man") == lower.encode("a man")
    assert cased.encode("A Man") != cased.encode("a man")
    assert lower.decode(lower.encode("A Man")) == "a man"
    assert lower.decode(lower.encode("Ünïcødé ÄÖÜ")) == "ünïcødé äöü"
    assert cased.decode(cased.encode("A Man")) == "A Man"
    # The merges were learned from lowercased text.
    assert merged_with_upper(lower) == [] != merged_with_upper(cased)
    # The normalizer travels in the JSON that runs and checkpoints store; cased has none.
    assert json.loads(lower.to_str())["normalizer"] == {"type": "Lowercase"}
    assert json.loads(cased.to_str())["normalizer"] is None
    reloaded = Tokenizer.from_str(lower.to_str())
    assert reloaded.encode("A Man") == lower.encode("a man")
    assert reloaded.fingerprint() == lower.fingerprint() != cased.fingerprint()


def test_cache_hit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = {
        "src": ["a small house", "a big house"] * 20,
        "tgt": ["ein kleines Haus", "ein großes Haus"] * 20,
    }
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows, features=FEATURES)})
    first = load_or_train_tokenizer(dd, tmp_path, vocab_size=300)
    assert len(list((tmp_path / "tokenizers").glob("*.json"))) == 1

    def fail(*args, **kwargs):
        raise AssertionError("trained again despite a cached tokenizer")

    monkeypatch.setattr(tokenizer_module.Tokenizer, "train", fail)
    second = load_or_train_tokenizer(dd, tmp_path, vocab_size=300)
    assert second.fingerprint() == first.fingerprint()
    monkeypatch.undo()
    load_or_train_tokenizer(dd, tmp_path, vocab_size=301)  # other settings: a new entry
    assert len(list((tmp_path / "tokenizers").glob("*.json"))) == 2
    lower = load_or_train_tokenizer(dd, tmp_path, vocab_size=300, lowercase=True)
    assert len(list((tmp_path / "tokenizers").glob("*.json"))) == 3
    assert lower.fingerprint() != first.fingerprint()
    assert lower.encode("A Small House") == lower.encode("a small house")
    again = load_or_train_tokenizer(dd, tmp_path, vocab_size=300)
    assert again.fingerprint() == first.fingerprint()
    with pytest.raises(ValueError, match="lowercase must be a bool, got 'no'"):
        load_or_train_tokenizer(dd, tmp_path, vocab_size=300, lowercase="no")
