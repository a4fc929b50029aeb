"""The long-document corpus and its windows, offline: built from pinned wheels by pip (here
wheels made by the test, taken from a local directory), split by directory within each
package in proportion to its bytes, with duplicates and near-duplicates (Jaccard or
containment) kept out of the held-out side, its licences read from the wheels' files, the
same bytes on every build; windows cut at offsets that the data seed fixes, the scored ones
drawn from every package by its bytes; bad settings refused in one line."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from multihead.data.code_corpus import (
    Package,
    build_code_corpus,
    held_out_directories,
    load_code_corpus,
    near_duplicate,
)
from multihead.data.documents import DocumentLMDataModule, allocate, cut_windows

from helpers.corpus import tiny_corpus_wheels

SPLITS = ("train", "validation", "test")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    where = tmp_path_factory.mktemp("wheels")
    return where, tiny_corpus_wheels(where)


@pytest.fixture(scope="module")
def corpus(wheels, tmp_path_factory):
    where, pins = wheels
    packages = tuple(Package(**p) for p in pins)
    return [
        build_code_corpus(tmp_path_factory.mktemp(f"c{i}"), packages, str(where)) for i in range(2)
    ]


def _lines(text: str) -> set[str]:
    return {s for line in text.splitlines() if len(s := line.strip()) > 8}


def _docs(root, split: str) -> list[dict]:
    return [json.loads(line) for line in (root / f"{split}.jsonl").read_text().splitlines()]


def test_the_corpus_is_built_by_pip_from_pinned_wheels_the_same_bytes_every_time(corpus, tmp_path):
    card = json.loads((corpus[0] / "card.json").read_text())
    for split in SPLITS:
        a, b = ((r / f"{split}.jsonl").read_bytes() for r in corpus)
        assert a == b
        assert card[split]["sha256"] == hashlib.sha256(a).hexdigest()
    docs = {split: _docs(corpus[0], split) for split in SPLITS}
    train, held = docs["train"], docs["validation"] + docs["test"]
    assert all(docs.values())
    paths = [d["path"] for d in train + held]
    assert "tinypkg/short.py" not in paths  # under MIN_BYTES
    assert len(paths) == len(set(paths))
    texts = [d["text"] for d in train + held]
    assert len(texts) == len(set(texts))  # the exact duplicate went
    assert card["dropped"]["exact_duplicates"] == 1
    # No split key (a path's first three components) on two sides, and no held-out file has
    # half its lines in one training file (containment; Jaccard is never above it).
    directory = lambda d: "/".join(d["path"].split("/")[:3])  # noqa: E731
    keys = [{directory(d) for d in docs[split]} for split in SPLITS]
    assert not (keys[0] & keys[1] or keys[0] & keys[2] or keys[1] & keys[2])
    for doc in held:
        mine = _lines(doc["text"])
        for other in (_lines(t["text"]) for t in train):
            assert len(mine & other) < 0.5 * len(mine)
    assert card["dropped"]["near_duplicates_jaccard"] >= 2  # near.py of each held-out directory
    # Read through datasets, the same texts.
    dataset = load_code_corpus(corpus[0], tmp_path / "hf")
    assert dataset["test"]["text"] == [d["text"] for d in docs["test"]]


def test_every_package_is_held_out_in_proportion_to_its_bytes():
    """40 directories of 1,000 bytes and 20 of 250: 5% of each package is 2 directories of
    the first and 1 of the second, in each held-out split."""
    docs = [{"package": "a", "path": f"a/d{i}/m.py", "text": "x" * 1000} for i in range(40)]
    docs += [{"package": "b", "path": f"b/d{i}/m.py", "text": "y" * 250} for i in range(20)]
    chosen = held_out_directories(docs)
    for package, per_split in (("a", 2), ("b", 1)):
        for split in ("test", "validation"):
            mine = [d for d, s in chosen.items() if s == split and d.startswith(package)]
            assert len(mine) == per_split, (package, split, mine)


def test_a_file_inside_a_much_larger_training_file_is_a_near_duplicate_jaccard_misses():
    big = "\n".join(f"value_{i} = compute({i}) + offset" for i in range(400))
    copied = "\n".join(big.splitlines()[100:150])  # 50 of its 400 lines
    other = "\n".join(f"unrelated_{i} = other({i}) * scale" for i in range(50))
    train = [("pkg/big.py", _lines(big))]
    # By hand: 50 shared lines; Jaccard 50 / 400 = 0.125, containment 50 / 50 = 1.
    assert near_duplicate(copied, train) == {
        "reason": "containment", "file": "pkg/big.py", "jaccard": 0.125, "containment": 1.0,
    }  # fmt: skip
    assert near_duplicate(other, train) is None
    assert near_duplicate(big, train)["reason"] == "jaccard"


def test_the_card_lists_every_licence_the_files_carry(corpus):
    card = json.loads((corpus[0] / "card.json").read_text())
    found = {(f["package"], f["file"]): (f["licences"], f["covers"]) for f in card["licences"]}
    assert found == {
        ("tinypkg", "tinypkg-1.0.dist-info/LICENSE"): (["MIT"], ""),
        ("tinypkg", "tinypkg/sub3/LICENSE.txt"): (["BSD-3-Clause"], "tinypkg/sub3/"),
        ("halfpkg", "halfpkg-1.0.dist-info/LICENSE"): (["BSD-3-Clause"], ""),
        ("halfpkg", "halfpkg-1.0.dist-info/LICENSE.python"): (["PSF-2.0"], ""),
    }  # halfpkg/static/vendor/LICENSE covers no document
    assert card["licence_ids"] == ["BSD-3-Clause", "MIT", "PSF-2.0"]
    kept = sum(card[split]["documents"] for split in SPLITS)
    package_wide = {f["package"]: f["documents"] for f in card["licences"] if f["covers"] == ""}
    assert sum(package_wide.values()) == kept


def test_a_wheel_whose_hash_differs_from_its_pin_is_refused(wheels, tmp_path):
    where, pins = wheels
    bad = Package(**{**pins[0], "sha256": "0" * 64})
    with pytest.raises(ConnectionError, match="pip download .* failed: .*(hash|HASH)"):
        build_code_corpus(tmp_path, (bad,), str(where))
    assert not list(tmp_path.glob("python-packages-v2-*"))  # nothing that looks finished


def test_windows_start_at_a_random_offset_and_follow_each_other():
    docs = [list(range(1000)), list(range(100)), list(range(5000, 5450))]
    windows, sources = cut_windows(docs, 200, np.random.default_rng(0))
    # The 100-token document is no longer than the context: no window.
    first = [w for w in windows if w[0] < 1000]
    starts = [int(w[0]) for w in first]
    assert starts == list(range(starts[0], 1000 - 199, 200))  # disjoint, in order
    assert 0 <= starts[0] <= 199
    third = [int(w[0]) for w in windows if w[0] >= 5000]
    assert third == list(range(third[0], 5450 - 199, 200)) and 5000 <= third[0] <= 5250
    assert all((np.diff(w) == 1).all() for w in windows)  # contiguous text
    assert sources.tolist() == [0] * len(first) + [2] * len(third)
    again, _ = cut_windows(docs, 200, np.random.default_rng(0))
    assert (again == windows).all()
    with pytest.raises(ValueError, match="no document is longer than context=2000"):
        cut_windows(docs, 2000, np.random.default_rng(0))


def test_windows_are_shared_by_bytes_every_package_at_least_one():
    # By hand: 64 x 4.9 / 29.6 = 10.59 and 53.41: 10 and 53, the one left to the larger
    # remainder; three of 3 take one each whatever their bytes.
    assert allocate(64, {"sympy": 24.7, "Django": 4.9}) == {"sympy": 53, "Django": 11}
    assert allocate(3, {"a": 1, "b": 1, "c": 100}) == {"a": 1, "b": 1, "c": 1}
    assert allocate(5, {"a": 1, "b": 1, "c": 100}) == {"a": 1, "b": 1, "c": 3}
    with pytest.raises(ValueError, match="2 windows cannot hold one of each of 3 packages"):
        allocate(2, {"a": 1, "b": 1, "c": 1})


@pytest.fixture(scope="module")
def datamodule(wheels, tmp_path_factory):
    where, pins = wheels
    dm = DocumentLMDataModule(
        context=128, vocab_size=300, batch_size=2, steps=3, val_windows=6, select_windows=3,
        cache_dir=tmp_path_factory.mktemp("cache"), packages=pins, find_links=str(where),
    )  # fmt: skip
    dm.setup()
    return dm


def test_the_scored_windows_come_from_every_package_by_its_bytes(datamodule):
    dm = datamodule
    assert dm.blocks["train"].shape[1] == 128 and dm.blocks["test"].shape == (6, 128)
    assert dm.blocks["validation"].shape == (3, 128)
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (2, 128) and batch.dtype.is_floating_point is False
    root = next(dm.cache_dir.glob("python-packages-v2-*"))
    card = json.loads((root / "card.json").read_text())
    docs = {split: _docs(root, split) for split in SPLITS}
    for split, n in (("test", 6), ("validation", 3)):
        # Each package's windows: within one of its share of the corpus's bytes.
        share = {
            p: sum(card[s]["packages"][p]["bytes"] for s in SPLITS)
            / sum(card[s]["bytes"] for s in SPLITS)
            for p in ("tinypkg", "halfpkg")
        }
        counts = {p: dm.groups[split].count(p) for p in share}
        assert sum(counts.values()) == n and all(c >= 1 for c in counts.values())
        assert all(abs(counts[p] - n * share[p]) < 1 for p in share), (counts, share)
        # Every window is text of a document of its split and its package, none of training's.
        train_text = (root / "train.jsonl").read_text()
        for window, package in zip(dm.blocks[split], dm.groups[split], strict=True):
            piece = json.dumps(dm.tokenizer.decode(window.tolist())[:60])[1:-1]
            assert any(
                piece in json.dumps(d["text"]) for d in docs[split] if d["package"] == package
            )
            assert piece not in train_text
    # The validation loaders: each package's scored windows, then the selection windows.
    assert dm.val_sets == [("val", "halfpkg"), ("val", "tinypkg"), ("select", None)]
    loaders = dm.val_dataloader()
    sizes = [sum(len(b) for b in loader) for loader in loaders]
    assert sizes == [dm.groups["test"].count("halfpkg"), dm.groups["test"].count("tinypkg"), 3]
    assert dm.stats["train"]["windows"] == len(dm.blocks["train"])


def test_a_run_longer_than_the_corpus_is_refused(wheels, datamodule):
    where, pins = wheels
    windows = len(datamodule.blocks["train"])
    dm = DocumentLMDataModule(
        context=128, vocab_size=300, batch_size=2, steps=windows, val_windows=6, select_windows=3,
        cache_dir=datamodule.cache_dir, packages=pins, find_links=str(where),
    )  # fmt: skip
    twice = rf"max_steps={windows} x data.batch_size=2 .* read windows twice"
    with pytest.raises(ValueError, match=twice):
        dm.setup()


@pytest.mark.parametrize(
    "key, value",
    [
        ("context", 0),
        ("batch_size", 1.5),
        ("vocab_size", True),
        ("steps", "10"),
        ("select_windows", 0),
    ],
)
def test_bad_settings_are_refused_by_name(key, value):
    with pytest.raises(ValueError, match=f"data.{key} must be"):
        DocumentLMDataModule(**{key: value})
