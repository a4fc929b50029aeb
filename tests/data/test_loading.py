from __future__ import annotations

import gzip
from pathlib import Path

import datasets
import pytest

from multihead.data import DataError, filter_parallel_dataset, load_parallel_dataset
from multihead.data.loading import FEATURES


def write(path: Path, lines: list[str] | bytes, compress: bool = True) -> Path:
    data = lines if isinstance(lines, bytes) else "".join(f"{x}\n" for x in lines).encode()
    if compress:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def make_corpus(root: Path, langs=("en", "de"), n=(4, 2, 2), compress=True) -> Path:
    for stem, count in zip(("train", "val", "test_2016_flickr"), n, strict=True):
        for lang in langs:
            write(root / f"{stem}.{lang}", [f"{lang} {stem} {i}" for i in range(count)], compress)
    return root


def test_real_corpus_shape(multi30k: datasets.DatasetDict) -> None:
    assert {split: len(ds) for split, ds in multi30k.items()} == {
        "train": 29000,
        "validation": 1014,
        "test": 1000,
    }
    assert multi30k["train"].features == FEATURES
    assert multi30k["train"][0] == {
        "src": "Two young, White males are outside near many bushes.",
        "tgt": "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
    }


def test_other_language_pair(multi30k_dir: Path) -> None:
    dd = load_parallel_dataset(src_lang="fr", tgt_lang="cs", local_dir=multi30k_dir)
    assert len(dd["validation"]) == 1014


@pytest.mark.parametrize("compress", [True, False])
def test_small_corpus(tmp_path: Path, compress: bool) -> None:
    dd = load_parallel_dataset(local_dir=make_corpus(tmp_path, compress=compress))
    assert list(dd) == ["train", "validation", "test"]
    assert dd["validation"][1] == {"src": "en val 1", "tgt": "de val 1"}
    assert dd["test"].column_names == ["src", "tgt"]


def test_missing_file(tmp_path: Path) -> None:
    make_corpus(tmp_path)
    (tmp_path / "val.de.gz").unlink()
    with pytest.raises(DataError, match=r"missing file .*val\.de\.gz.*expected layout"):
        load_parallel_dataset(local_dir=tmp_path)


def test_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nowhere is not a directory"):
        load_parallel_dataset(local_dir=tmp_path / "nowhere")


def test_line_count_mismatch(tmp_path: Path) -> None:
    make_corpus(tmp_path)
    write(tmp_path / "test_2016_flickr.de", ["a", "b", "c"])
    with pytest.raises(DataError) as info:
        load_parallel_dataset(local_dir=tmp_path)
    message = str(info.value)
    assert "test_2016_flickr.en.gz has 2 lines" in message
    assert "test_2016_flickr.de.gz has 3" in message
    assert "\n" not in message


def test_undecodable_bytes(tmp_path: Path) -> None:
    make_corpus(tmp_path)
    write(tmp_path / "train.de", b"ok\nfine\nbad \xff byte\nok\n")
    with pytest.raises(DataError, match=r"train\.de\.gz:3: bytes are not valid UTF-8"):
        load_parallel_dataset(local_dir=tmp_path)


def test_not_gzip(tmp_path: Path) -> None:
    make_corpus(tmp_path)
    (tmp_path / "train.en.gz").write_bytes(b"plain text\n")
    with pytest.raises(DataError, match=r"train\.en\.gz: not a valid gzip file"):
        load_parallel_dataset(local_dir=tmp_path)


def test_unknown_language_local(tmp_path: Path) -> None:
    make_corpus(tmp_path, langs=("en", "de", "fr"))
    with pytest.raises(
        DataError, match=r"language 'xx' not found in .*available: \['de', 'en', 'fr'\]"
    ):
        load_parallel_dataset(src_lang="xx", local_dir=tmp_path)


def test_unknown_language_hub() -> None:
    with pytest.raises(
        DataError, match=r"'fr' is not in dataset 'bentrevett/multi30k'.*\['en', 'de'\]"
    ):
        load_parallel_dataset(tgt_lang="fr")


def test_unknown_dataset_and_same_languages() -> None:
    with pytest.raises(DataError, match="unknown dataset 'nope'"):
        load_parallel_dataset(name="nope")
    with pytest.raises(DataError, match="both 'en'"):
        load_parallel_dataset(src_lang="en", tgt_lang="en")


def test_offline_hub_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(*args, **kwargs):
        raise ConnectionError(
            "Couldn't reach 'bentrevett/multi30k' on the Hub (OfflineModeIsEnabled)"
        )

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError) as info:
        load_parallel_dataset()
    message = str(info.value)
    assert "bentrevett/multi30k" in message and "data.local_dir=" in message
    assert "\n" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_hub_translation_column_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake(repo_id, config):
        calls.append((repo_id, config))
        rows = {"translation": [{"de": "Hallo", "en": "Hello"}]}
        return datasets.DatasetDict(
            {s: datasets.Dataset.from_dict(rows) for s in ("train", "validation", "test")}
        )

    monkeypatch.setattr(datasets, "load_dataset", fake)
    dd = load_parallel_dataset(name="wmt14", src_lang="en", tgt_lang="de")
    assert dd["train"][0] == {"src": "Hello", "tgt": "Hallo"}
    assert dd["train"].features == FEATURES
    load_parallel_dataset(name="iwslt2017", src_lang="de", tgt_lang="en")
    assert calls == [("wmt/wmt14", "de-en"), ("IWSLT/iwslt2017", "iwslt2017-de-en")]


def test_filtering_counts() -> None:
    long = " ".join(["w"] * 6)
    rows = {"src": ["a b", "", "x", long, "  ", "ok"], "tgt": ["c", "d", "", "y", "z", long]}
    dd = datasets.DatasetDict(
        {
            s: datasets.Dataset.from_dict(rows, features=FEATURES)
            for s in ("train", "validation", "test")
        }
    )
    filtered, stats = filter_parallel_dataset(dd, max_length=5)
    assert filtered["train"]["src"] == ["a b"]
    assert (stats["train"].total, stats["train"].empty, stats["train"].too_long) == (6, 3, 2)
    assert stats["train"].kept == 1
    assert len(filtered["validation"]) == 1
    assert len(filtered["test"]) == 6 and "test" not in stats  # references stay intact
    unlimited, stats = filter_parallel_dataset(dd, max_length=None)
    assert len(unlimited["train"]) == 3 and stats["train"].too_long == 0
    with pytest.raises(ValueError, match="max_length must be .* got 0"):
        filter_parallel_dataset(dd, max_length=0)


def test_real_corpus_filtering(multi30k: datasets.DatasetDict) -> None:
    _, stats = filter_parallel_dataset(multi30k, max_length=100)
    assert stats["train"].kept == 29000 and stats["validation"].kept == 1014
