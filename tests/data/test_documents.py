"""The long-document corpus and its windows, offline: built from pinned wheels by pip (here
wheels made by the test, taken from a local directory), split by directory with duplicates
and near-duplicates kept out of the held-out side, the same bytes on every build; windows
cut at offsets that the data seed fixes; bad settings refused in one line."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from multihead.data.code_corpus import Package, build_code_corpus, load_code_corpus
from multihead.data.documents import DocumentLMDataModule, cut_windows

from helpers.corpus import tiny_corpus_wheels


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    where = tmp_path_factory.mktemp("wheels")
    return where, tiny_corpus_wheels(where)


def _lines(text: str) -> set[str]:
    return {s for line in text.splitlines() if len(s := line.strip()) > 8}


def test_the_corpus_is_built_by_pip_from_pinned_wheels_the_same_bytes_every_time(wheels, tmp_path):
    where, pins = wheels
    packages = tuple(Package(**p) for p in pins)
    roots = [build_code_corpus(tmp_path / f"c{i}", packages, str(where)) for i in range(2)]
    for split in ("train", "validation"):
        a, b = ((r / f"{split}.jsonl").read_bytes() for r in roots)
        assert a == b
        card = json.loads((roots[0] / "card.json").read_text())
        assert card[split]["sha256"] == hashlib.sha256(a).hexdigest()
    docs = {
        split: [json.loads(line) for line in (roots[0] / f"{split}.jsonl").read_text().splitlines()]
        for split in ("train", "validation")
    }
    train, held = docs["train"], docs["validation"]
    assert train and held
    paths = [d["path"] for d in train + held]
    assert "tinypkg/short.py" not in paths  # under MIN_BYTES
    assert len(paths) == len(set(paths))
    texts = [d["text"] for d in train + held]
    assert len(texts) == len(set(texts))  # the exact duplicate went
    assert card["dropped"]["exact_duplicates"] == 1
    # No split key (a path's first three components) on both sides, and no held-out file shares
    # half its lines with a training one.
    directory = lambda d: "/".join(d["path"].split("/")[:3])  # noqa: E731
    assert not {directory(d) for d in train} & {directory(d) for d in held}
    for doc in held:
        mine = _lines(doc["text"])
        for other in (_lines(t["text"]) for t in train):
            assert len(mine & other) < 0.5 * len(mine | other)
    assert card["dropped"]["near_duplicates"] >= 1  # the near.py of each held-out directory
    # Read through datasets, the same texts.
    dataset = load_code_corpus(roots[0], tmp_path / "hf")
    assert dataset["validation"]["text"] == [d["text"] for d in held]


def test_a_wheel_whose_hash_differs_from_its_pin_is_refused(wheels, tmp_path):
    where, pins = wheels
    bad = Package(**{**pins[0], "sha256": "0" * 64})
    with pytest.raises(ConnectionError, match="pip download .* failed: .*(hash|HASH)"):
        build_code_corpus(tmp_path, (bad,), str(where))
    assert not list(tmp_path.glob("python-packages-v1-*"))  # nothing that looks finished


def test_windows_start_at_a_random_offset_and_follow_each_other():
    docs = [list(range(1000)), list(range(100)), list(range(5000, 5450))]
    windows = cut_windows(docs, 200, np.random.default_rng(0))
    # The 100-token document is no longer than the context: no window.
    first = [w for w in windows if w[0] < 1000]
    starts = [int(w[0]) for w in first]
    assert starts == list(range(starts[0], 1000 - 199, 200))  # disjoint, in order
    assert 0 <= starts[0] <= 199
    third = [int(w[0]) for w in windows if w[0] >= 5000]
    assert third == list(range(third[0], 5450 - 199, 200)) and 5000 <= third[0] <= 5250
    assert all((np.diff(w) == 1).all() for w in windows)  # contiguous text
    again = cut_windows(docs, 200, np.random.default_rng(0))
    assert (again == windows).all()
    with pytest.raises(ValueError, match="no document is longer than context=2000"):
        cut_windows(docs, 2000, np.random.default_rng(0))


@pytest.fixture(scope="module")
def datamodule(wheels, tmp_path_factory):
    where, pins = wheels
    dm = DocumentLMDataModule(
        context=128, vocab_size=300, batch_size=2, steps=3, val_windows=4,
        cache_dir=tmp_path_factory.mktemp("cache"), packages=pins, find_links=str(where),
    )  # fmt: skip
    dm.setup()
    return dm


def test_the_datamodule_gives_windows_of_the_context_from_the_held_out_documents(datamodule):
    dm = datamodule
    assert dm.blocks["train"].shape[1] == 128 and dm.blocks["validation"].shape == (4, 128)
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (2, 128) and batch.dtype.is_floating_point is False
    # Every held-out window is text of a held-out document.
    held = "".join(dm.tokenizer.decode(w.tolist()) for w in dm.blocks["validation"])
    root = next(dm.cache_dir.glob("python-packages-v1-*"))
    held_text = (root / "validation.jsonl").read_text()
    train_text = (root / "train.jsonl").read_text()
    for w in dm.blocks["validation"]:
        piece = dm.tokenizer.decode(w.tolist())[:60]
        assert json.dumps(piece)[1:-1] in held_text
        assert json.dumps(piece)[1:-1] not in train_text
    assert held
    assert dm.stats["train"]["windows"] == len(dm.blocks["train"])


def test_a_run_longer_than_the_corpus_is_refused(wheels, datamodule):
    where, pins = wheels
    windows = len(datamodule.blocks["train"])
    dm = DocumentLMDataModule(
        context=128, vocab_size=300, batch_size=2, steps=windows, val_windows=4,
        cache_dir=datamodule.cache_dir, packages=pins, find_links=str(where),
    )  # fmt: skip
    twice = rf"max_steps={windows} x data.batch_size=2 .* read windows twice"
    with pytest.raises(ValueError, match=twice):
        dm.setup()


@pytest.mark.parametrize(
    "key, value", [("context", 0), ("batch_size", 1.5), ("vocab_size", True), ("steps", "10")]
)
def test_bad_settings_are_refused_by_name(key, value):
    with pytest.raises(ValueError, match=f"data.{key} must be"):
        DocumentLMDataModule(**{key: value})
