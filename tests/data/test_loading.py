from __future__ import annotations

import gzip
from collections.abc import Callable
from pathlib import Path

import datasets
import huggingface_hub
import pytest

from multihead.data import DataError, filter_parallel_dataset, load_parallel_dataset, read_lines
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


def load_error(local_dir: Path, **kwargs) -> str:
    """The one-line message of the DataError that loading ``local_dir`` raises."""
    with pytest.raises(DataError) as info:
        load_parallel_dataset(local_dir=local_dir, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    assert info.value.__cause__ is None  # no library traceback chained under it
    return message


def test_missing_files_are_all_named(tmp_path: Path) -> None:
    make_corpus(tmp_path)
    (tmp_path / "val.de.gz").unlink()
    (tmp_path / "test_2016_flickr.en.gz").unlink()
    message = load_error(tmp_path)
    assert message == (
        f"missing files in {tmp_path}: val.de[.gz], test_2016_flickr.en[.gz]; "
        "expected layout {train,val,test_2016_flickr}.{lang}[.gz]"
    )


def test_missing_or_empty_dir(tmp_path: Path) -> None:
    layout = "{train,val,test_2016_flickr}.{lang}[.gz]"
    assert load_error(tmp_path / "nowhere") == (
        f"local_dir {tmp_path / 'nowhere'} is not a directory; expected raw Multi30k files {layout}"
    )
    (tmp_path / "a_file").write_text("x\n")
    assert "a_file is not a directory" in load_error(tmp_path / "a_file")
    assert load_error(tmp_path) == (
        f"no training files train.{{lang}}[.gz] in {tmp_path}; expected {layout}"
    )


@pytest.mark.parametrize("compress", [True, False])
def test_line_count_mismatch(tmp_path: Path, compress: bool) -> None:
    make_corpus(tmp_path, compress=compress)
    write(tmp_path / "test_2016_flickr.de", ["a", "b", "c"], compress)
    ext = ".gz" if compress else ""
    message = load_error(tmp_path)
    assert message.startswith(
        f"line counts differ: {tmp_path}/test_2016_flickr.en{ext} has 2 lines, "
        f"{tmp_path}/test_2016_flickr.de{ext} has 3; expected line i"
    )


def test_line_count_mismatch_from_trailing_empty_lines(tmp_path: Path) -> None:
    make_corpus(tmp_path)
    write(tmp_path / "train.en", ["en train 0", "en train 1", "en train 2", "en train 3", "", ""])
    message = load_error(tmp_path)
    assert "train.en.gz has 6 lines" in message and "train.de.gz has 4" in message
    assert "the longer file ends with 2 empty line(s)" in message


def test_empty_lines_are_filtered_with_a_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make_corpus(tmp_path)
    write(tmp_path / "train.en", ["one", "", "three", "four"])
    write(tmp_path / "train.de", ["eins", "zwei", "   ", "vier"])
    write(tmp_path / "test_2016_flickr.de", ["", "de test 1"])
    dd = load_parallel_dataset(local_dir=tmp_path)
    assert dd["train"]["src"] == ["one", "", "three", "four"]  # loading keeps the alignment
    with caplog.at_level("INFO", logger="multihead.data.loading"):
        filtered, stats = filter_parallel_dataset(dd)
    assert filtered["train"]["src"] == ["one", "four"]
    assert filtered["train"]["tgt"] == ["eins", "vier"]
    assert (stats["train"].total, stats["train"].empty, stats["train"].kept) == (4, 2, 2)
    assert "filtered train: kept 2 of 4 pairs (2 empty, 0 longer than 100 words)" in caplog.text
    # The test split keeps its empty reference (BLEU needs every line) but says so.
    assert filtered["test"]["tgt"] == ["", "de test 1"]
    assert "test has 1 of 2 pairs with an empty side; kept, since test is not filtered" in (
        caplog.text
    )


def test_split_left_empty_by_filtering(tmp_path: Path) -> None:
    make_corpus(tmp_path, n=(3, 2, 2))
    write(tmp_path / "train.en", ["", "x " * 5, "  "])
    dd = load_parallel_dataset(local_dir=tmp_path)
    with pytest.raises(DataError) as info:
        filter_parallel_dataset(dd, max_length=4)
    assert str(info.value) == (
        "no train pairs left: all 3 were dropped (2 with an empty side, 1 longer than "
        "max_length=4 words); expected at least one usable pair"
    )


@pytest.mark.parametrize("compress", [True, False])
def test_undecodable_bytes(tmp_path: Path, compress: bool) -> None:
    make_corpus(tmp_path, compress=compress)
    write(tmp_path / "train.de", b"ok\nfine\nbad \xff byte\nok\n", compress)
    ext = ".gz" if compress else ""
    assert load_error(tmp_path) == (
        f"{tmp_path}/train.de{ext}:3: bytes are not valid UTF-8 "
        r"(invalid start byte at byte 4: b'\xff by')"
    )


def test_byte_order_mark_is_dropped(tmp_path: Path) -> None:
    make_corpus(tmp_path)
    write(tmp_path / "train.en", "\ufeffhello\nen train 1\nen train 2\nen train 3\n".encode())
    assert load_parallel_dataset(local_dir=tmp_path)["train"]["src"][0] == "hello"


@pytest.mark.parametrize("compress", [True, False])
def test_empty_file(tmp_path: Path, compress: bool) -> None:
    make_corpus(tmp_path, compress=compress)
    write(tmp_path / "val.en", [], compress)  # as compressed: a valid gzip of zero bytes
    ext = ".gz" if compress else ""
    assert (
        load_error(tmp_path) == f"{tmp_path}/val.en{ext} is empty; expected one sentence per line"
    )


def test_zero_byte_gzip_is_empty(tmp_path: Path) -> None:
    make_corpus(tmp_path)
    (tmp_path / "val.de.gz").write_bytes(b"")
    assert load_error(tmp_path) == f"{tmp_path}/val.de.gz is empty; expected one sentence per line"


def corrupt_gzip(path: Path) -> None:
    """Give the first deflate block the reserved block type 0b11 (RFC 1951, section 3.2.3)."""
    data = bytearray(gzip.compress(b"a\nb\nc\nd\n"))
    data[10] |= 0b110  # byte 10 follows the 10-byte gzip header; bits 1-2 are BTYPE
    path.write_bytes(bytes(data))


def truncate_gzip(path: Path) -> None:
    data = gzip.compress("".join(f"line {i}\n" for i in range(4000)).encode())
    path.write_bytes(data[: len(data) // 2])


def bad_checksum(path: Path) -> None:
    data = bytearray(gzip.compress(b"a\nb\nc\nd\n"))
    data[-8] ^= 0xFF  # the CRC-32 of the trailer
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda path: path.write_bytes(b"plain text\n"), "Not a gzipped file"),
        (corrupt_gzip, "Error -3 while decompressing data: invalid block type"),
        (truncate_gzip, "Compressed file ended before the end-of-stream marker"),
        (bad_checksum, "CRC check failed"),
    ],
    ids=["not-gzip", "corrupt", "truncated", "bad-crc"],
)
def test_bad_gzip(tmp_path: Path, damage: Callable[[Path], None], reason: str) -> None:
    make_corpus(tmp_path)
    damage(tmp_path / "train.en.gz")
    message = load_error(tmp_path)
    assert message.startswith(f"{tmp_path}/train.en.gz: not a valid gzip file (")
    assert reason in message


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=f"^{tmp_path}: cannot read: Is a directory$"):
        read_lines(tmp_path)


def test_unknown_language_local(tmp_path: Path) -> None:
    make_corpus(tmp_path, langs=("en", "de", "fr"))
    assert load_error(tmp_path, src_lang="xx") == (
        f"language 'xx' not found in {tmp_path}; available: ['de', 'en', 'fr']"
    )


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


# The Hub's Parquet conversions, as their refs/convert/parquet branches lay them out:
# IWSLT/iwslt2017 has iwslt2017-de-en/{train,validation,test}/0000.parquet (one config per
# direction); wmt/wmt14 has de-en/train/0000.parquet to 0002.parquet, de-en/validation/...
# (one config for both directions). (name, src, tgt) -> (repo, config, train shards)
PARQUET_CASES = {
    ("iwslt2017", "de", "en"): ("IWSLT/iwslt2017", "iwslt2017-de-en", 1),
    ("iwslt2017", "en", "de"): ("IWSLT/iwslt2017", "iwslt2017-en-de", 1),
    ("wmt14", "de", "en"): ("wmt/wmt14", "de-en", 2),
    ("wmt14", "en", "de"): ("wmt/wmt14", "de-en", 2),
}


def write_parquet_conversion(root: Path, config: str, train_shards: int = 1) -> Path:
    """A tiny copy of a Parquet conversion: one ``translation`` column, as on the Hub."""
    languages = ["de", "en"]
    features = datasets.Features({"translation": datasets.Translation(languages=languages)})
    shards = {"train": train_shards, "validation": 1, "test": 1}
    for split, count in shards.items():
        for shard in range(count):
            rows = [{lang: f"{lang} {split} {shard}.{i}" for lang in languages} for i in range(2)]
            path = root / config / split / f"{shard:04d}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            table = datasets.Dataset.from_dict({"translation": rows}, features=features)
            table.to_parquet(str(path))
    return root


@pytest.fixture
def datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load_dataset's Arrow cache in tmp_path, not in the user's cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


@pytest.mark.parametrize("name, src_lang, tgt_lang", sorted(PARQUET_CASES))
def test_hub_reads_the_parquet_conversion(
    name, src_lang, tgt_lang, tmp_path, monkeypatch, datasets_cache
) -> None:
    """The Hub's branch is read with the config's data files; the fixture stands for it."""
    repo_id, config, train_shards = PARQUET_CASES[name, src_lang, tgt_lang]
    hub = write_parquet_conversion(tmp_path / "hub", config, train_shards)
    real_load_dataset = datasets.load_dataset
    calls = []

    def from_fixture(path, *args, **kwargs):
        calls.append((path, args, kwargs))
        # The relative data files, resolved in the fixture as the Hub resolves them in the repo.
        files = {split: str(hub / pattern) for split, pattern in kwargs["data_files"].items()}
        return real_load_dataset("parquet", data_files=files)

    monkeypatch.setattr(datasets, "load_dataset", from_fixture)
    dd = load_parallel_dataset(name=name, src_lang=src_lang, tgt_lang=tgt_lang)
    assert calls == [
        (
            repo_id,
            (),
            {
                "revision": "refs/convert/parquet",
                "data_files": {
                    "train": f"{config}/train/*.parquet",
                    "validation": f"{config}/validation/*.parquet",
                    "test": f"{config}/test/*.parquet",
                },
            },
        )
    ]
    assert {split: len(ds) for split, ds in dd.items()} == {
        "train": 2 * train_shards,
        "validation": 2,
        "test": 2,
    }
    assert dd["train"].features == FEATURES
    assert dd["validation"][1] == {
        "src": f"{src_lang} validation 0.1",
        "tgt": f"{tgt_lang} validation 0.1",
    }
    assert dd["train"][-1]["src"] == f"{src_lang} train {train_shards - 1}.1"


@pytest.mark.parametrize("name, src_lang, tgt_lang", sorted(PARQUET_CASES))
def test_local_copy_of_the_parquet_conversion(
    name, src_lang, tgt_lang, tmp_path, monkeypatch, datasets_cache
) -> None:
    _, config, train_shards = PARQUET_CASES[name, src_lang, tgt_lang]
    copy = write_parquet_conversion(tmp_path / "copy", config, train_shards)
    real_load_dataset = datasets.load_dataset

    def local_only(path, *args, **kwargs):
        assert path == "parquet", f"the Hub was asked for {path}"
        return real_load_dataset(path, *args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", local_only)
    dd = load_parallel_dataset(name=name, src_lang=src_lang, tgt_lang=tgt_lang, local_dir=copy)
    assert list(dd) == ["train", "validation", "test"]
    assert dd["test"][0] == {"src": f"{src_lang} test 0.0", "tgt": f"{tgt_lang} test 0.0"}
    assert len(dd["train"]) == 2 * train_shards


def test_local_parquet_copy_with_missing_files_is_one_line(tmp_path, datasets_cache) -> None:
    copy = write_parquet_conversion(tmp_path, "iwslt2017-de-en")
    (copy / "iwslt2017-de-en" / "test" / "0000.parquet").unlink()
    with pytest.raises(DataError) as info:
        load_parallel_dataset(name="iwslt2017", src_lang="de", tgt_lang="en", local_dir=copy)
    assert str(info.value) == (
        f"missing files in {copy}: iwslt2017-de-en/test/*.parquet; expected IWSLT/iwslt2017's "
        f"Parquet files (refs/convert/parquet) as {copy}/iwslt2017-de-en/"
        "{train,validation,test}/*.parquet"
    )
    with pytest.raises(DataError, match=f"^local_dir {tmp_path / 'nowhere'} is not a directory"):
        load_parallel_dataset(name="wmt14", local_dir=tmp_path / "nowhere")


@pytest.mark.parametrize(
    "name, repo_id, config",
    [("iwslt2017", "IWSLT/iwslt2017", "iwslt2017-de-en"), ("wmt14", "wmt/wmt14", "de-en")],
)
def test_parquet_datasets_offline_are_one_line_naming_the_dataset_and_local_dir(
    name, repo_id, config, monkeypatch
) -> None:
    """The real loader, offline: what a machine without network gets."""
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError) as info:
        load_parallel_dataset(name=name, src_lang="de", tgt_lang="en")
    message = str(info.value)
    assert "\n" not in message and info.value.__cause__ is None
    assert message.startswith(
        f"could not load dataset '{name}' ({repo_id}, config '{config}', Parquet files of "
        "refs/convert/parquet) from the Hugging Face Hub: "
    )
    assert message.endswith(
        f"Offline? download them (hf download {repo_id} --repo-type dataset --revision "
        f"refs/convert/parquet --include '{config}/*' --local-dir DIR) and set "
        "data.local_dir=DIR"
    )


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
