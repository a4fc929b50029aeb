"""Load a parallel corpus as a ``DatasetDict`` with string columns ``src`` and ``tgt``.

Every source gives the same structure (splits ``train``, ``validation``, ``test``):

* the Hugging Face Hub: ``bentrevett/multi30k`` as it is, and ``iwslt2017`` and ``wmt14``
  from the Hub's Parquet conversion of them (branch ``refs/convert/parquet``, files
  ``<config>/<split>/NNNN.parquet``): ``IWSLT/iwslt2017`` is a loading script, which
  ``datasets`` 4 and later refuse to run, and the conversion holds its data as Parquet;
* a local directory: the raw Multi30k layout ``{train,val,test_2016_flickr}.{lang}[.gz]``,
  or for ``iwslt2017`` and ``wmt14`` a copy of their Parquet files in the Hub's layout.

Every data problem raises :class:`DataError` with a one-line message that names the file
(and line) at fault.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets

logger = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
FEATURES = datasets.Features({"src": datasets.Value("string"), "tgt": datasets.Value("string")})

# Raw Multi30k file stems, by split.
MULTI30K_STEMS = {"train": "train", "validation": "val", "test": "test_2016_flickr"}

# Splits that filter_parallel_dataset cleans. The test split is never filtered so
# that BLEU is always computed against the complete, official reference set.
FILTERED_SPLITS = ("train", "validation")


class DataError(ValueError):
    """A dataset could not be loaded or is malformed; the message names the file and line."""


# The branch where the Hub keeps a Parquet conversion of every public dataset.
PARQUET_REVISION = "refs/convert/parquet"


@dataclass(frozen=True)
class _HubSpec:
    repo_id: str
    languages: tuple[str, ...]
    pairs: Callable[[str, str], str | None]  # (src, tgt) -> config name, None if unsupported
    translation_column: bool  # True: one `translation` dict column; False: a column per language
    parquet: bool  # True: read the Parquet conversion (PARQUET_REVISION), not the main branch


_IWSLT2017_PAIRS = {
    *(f"{a}-{b}" for a in ("en",) for b in ("ar", "de", "fr", "ja", "ko", "zh", "it", "nl", "ro")),
    *(f"{b}-en" for b in ("ar", "de", "fr", "ja", "ko", "zh", "it", "nl", "ro")),
    *(f"{a}-{b}" for a in ("it", "nl", "ro") for b in ("it", "nl", "ro") if a != b),
}
_WMT14_CONFIGS = ("cs-en", "de-en", "fr-en", "hi-en", "ru-en")


def _iwslt_config(src: str, tgt: str) -> str | None:
    return f"iwslt2017-{src}-{tgt}" if f"{src}-{tgt}" in _IWSLT2017_PAIRS else None


def _wmt14_config(src: str, tgt: str) -> str | None:
    return next((c for c in _WMT14_CONFIGS if set(c.split("-")) == {src, tgt}), None)


HUB_DATASETS: dict[str, _HubSpec] = {
    "bentrevett/multi30k": _HubSpec(
        repo_id="bentrevett/multi30k",
        languages=("en", "de"),
        pairs=lambda s, t: None if s == t else "default",
        translation_column=False,
        parquet=False,
    ),
    "iwslt2017": _HubSpec(
        repo_id="IWSLT/iwslt2017",
        languages=("ar", "de", "en", "fr", "it", "ja", "ko", "nl", "ro", "zh"),
        pairs=_iwslt_config,
        translation_column=True,
        parquet=True,
    ),
    "wmt14": _HubSpec(
        repo_id="wmt/wmt14",
        languages=("cs", "de", "en", "fr", "hi", "ru"),
        pairs=_wmt14_config,
        translation_column=True,
        parquet=True,
    ),
}


@dataclass(frozen=True)
class FilterStats:
    """How many pairs of one split were kept and why the others were dropped."""

    split: str
    total: int
    empty: int
    too_long: int

    @property
    def kept(self) -> int:
        """Number of pairs left after filtering."""
        return self.total - self.empty - self.too_long


def load_parallel_dataset(
    name: str = "bentrevett/multi30k",
    src_lang: str = "en",
    tgt_lang: str = "de",
    local_dir: str | Path | None = None,
) -> datasets.DatasetDict:
    """Load a translation corpus as splits ``train``/``validation``/``test`` of ``src``/``tgt``.

    Args:
        name: Hub dataset, one of ``bentrevett/multi30k``, ``iwslt2017``, ``wmt14``.
        src_lang: Source language code, e.g. ``"en"``.
        tgt_lang: Target language code, e.g. ``"de"``.
        local_dir: A local copy; when set, the Hub is not contacted. For ``iwslt2017`` and
            ``wmt14``, their Parquet files in the Hub's layout
            ``<config>/{train,validation,test}/*.parquet`` (see :func:`parquet_files`);
            for Multi30k, raw files ``{train,val,test_2016_flickr}.{lang}[.gz]``.

    Returns:
        A ``DatasetDict`` whose splits have the string columns ``src`` and ``tgt``. Local
        sentences are stripped of surrounding whitespace.

    Raises:
        DataError: The dataset is unknown or unreachable, a language is not available, a file
            is missing, has undecodable bytes or a line count that differs between languages.
    """
    if src_lang == tgt_lang:
        raise DataError(f"src_lang and tgt_lang are both {src_lang!r}; expected two languages")
    spec = HUB_DATASETS.get(name)
    if local_dir is not None and (spec is None or not spec.parquet):
        return _load_multi30k_dir(Path(local_dir), src_lang, tgt_lang)
    return _load_hub(name, src_lang, tgt_lang, local_dir)


def parquet_files(config: str) -> dict[str, str]:
    """Where the Hub's Parquet conversion keeps ``config``'s splits, relative to its root."""
    return {split: f"{config}/{split}/*.parquet" for split in SPLITS}


def _read_parquet_copy(directory: Path, spec: _HubSpec, config: str) -> datasets.DatasetDict:
    """``config``'s splits from a local copy of ``spec``'s Parquet conversion."""
    files = parquet_files(config)
    layout = f"{directory}/{config}/{{{','.join(SPLITS)}}}/*.parquet"
    if not directory.is_dir():
        raise DataError(
            f"local_dir {directory} is not a directory; expected {spec.repo_id}'s Parquet "
            f"files ({PARQUET_REVISION}) as {layout}"
        )
    missing = [pattern for pattern in files.values() if not any(directory.glob(pattern))]
    if missing:
        raise DataError(
            f"missing files in {directory}: {', '.join(missing)}; expected {spec.repo_id}'s "
            f"Parquet files ({PARQUET_REVISION}) as {layout}"
        )
    local = {split: str(directory / pattern) for split, pattern in files.items()}
    return datasets.load_dataset("parquet", data_files=local)


def _load_hub(
    name: str, src_lang: str, tgt_lang: str, local_dir: str | Path | None = None
) -> datasets.DatasetDict:
    """A dataset of :data:`HUB_DATASETS`: from the Hub, or a local copy of its Parquet files."""
    spec = HUB_DATASETS.get(name)
    if spec is None:
        raise DataError(
            f"unknown dataset {name!r}; expected one of {sorted(HUB_DATASETS)} "
            "or a raw Multi30k directory via data.local_dir=..."
        )
    for lang in (src_lang, tgt_lang):
        if lang not in spec.languages:
            raise DataError(
                f"language {lang!r} is not in dataset {name!r}; available: {list(spec.languages)}"
            )
    config = spec.pairs(src_lang, tgt_lang)
    if config is None:
        raise DataError(f"dataset {name!r} has no {src_lang}-{tgt_lang} pair")
    if local_dir is not None:
        raw = _read_parquet_copy(Path(local_dir), spec, config)
    else:
        try:
            if spec.parquet:
                raw = datasets.load_dataset(
                    spec.repo_id, revision=PARQUET_REVISION, data_files=parquet_files(config)
                )
            else:
                raw = datasets.load_dataset(spec.repo_id, None if config == "default" else config)
        except (ConnectionError, OSError) as exc:
            # Offline or no network: ConnectionError; a missing repo: FileNotFoundError.
            raise DataError(_unreachable(name, spec, config, exc)) from None
    missing = [split for split in SPLITS if split not in raw]
    if missing:
        raise DataError(f"dataset {name!r} lacks splits {missing}; found {list(raw)}")

    out = {}
    for split in SPLITS:
        ds = raw[split]
        if spec.translation_column:
            ds = ds.map(
                lambda batch: {
                    "src": [pair[src_lang] for pair in batch["translation"]],
                    "tgt": [pair[tgt_lang] for pair in batch["translation"]],
                },
                batched=True,
                remove_columns=ds.column_names,
            )
        else:
            ds = ds.select_columns([src_lang, tgt_lang]).rename_columns(
                {src_lang: "src", tgt_lang: "tgt"}
            )
        out[split] = ds.cast(FEATURES)
    return datasets.DatasetDict(out)


def _unreachable(name: str, spec: _HubSpec, config: str, exc: Exception) -> str:
    """One line: which dataset could not be loaded, why, and the local copy to use instead."""
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if spec.parquet:
        where = f"{spec.repo_id}, config {config!r}, Parquet files of {PARQUET_REVISION}"
        copy = (
            f"download them (hf download {spec.repo_id} --repo-type dataset --revision "
            f"{PARQUET_REVISION} --include '{config}/*' --local-dir DIR) and set "
            "data.local_dir=DIR"
        )
    else:
        where = f"{spec.repo_id}, config {config!r}"
        copy = "use a local copy: data.local_dir=/path/to/multi30k"
    return (
        f"could not load dataset {name!r} ({where}) from the Hugging Face Hub: {reason}. "
        f"Offline? {copy}"
    )


def _find_file(directory: Path, stem: str, lang: str) -> Path | None:
    candidates = (directory / f"{stem}.{lang}.gz", directory / f"{stem}.{lang}")
    return next((path for path in candidates if path.is_file()), None)


def available_local_languages(directory: str | Path) -> list[str]:
    """Languages for which ``directory`` has all three Multi30k split files."""
    directory = Path(directory)
    langs = set()
    for path in directory.glob(f"{MULTI30K_STEMS['train']}.*"):
        lang = path.name.split(".")[1]
        if all(_find_file(directory, stem, lang) for stem in MULTI30K_STEMS.values()):
            langs.add(lang)
    return sorted(langs)


def read_lines(path: str | Path) -> list[str]:
    """Read a UTF-8 text file (gzip-compressed when it ends in ``.gz``), one sentence a line.

    Lines are split on ``\\n`` only (never on other Unicode line breaks, which would break the
    line alignment between languages) and stripped of surrounding whitespace. A UTF-8 byte
    order mark at the start of the file is dropped.

    Raises:
        DataError: The file cannot be read, has bytes that are not UTF-8 (names the line), is
            not valid gzip (truncated, corrupt or not compressed) or has no lines at all.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    lines = []
    lineno = 0
    try:
        with opener(path, "rb") as handle:
            for lineno, raw in enumerate(handle, start=1):
                # A BOM (written by some Windows editors) would otherwise stick to sentence 1.
                encoding = "utf-8-sig" if lineno == 1 else "utf-8"
                try:
                    lines.append(raw.decode(encoding).strip())
                except UnicodeDecodeError as exc:
                    raise DataError(
                        f"{path}:{lineno}: bytes are not valid UTF-8 ({exc.reason} at byte "
                        f"{exc.start}: {raw[exc.start : exc.start + 4]!r})"
                    ) from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise DataError(
            f"{path}: not a valid gzip file ({exc}); {lineno} lines were read before the error"
        ) from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not lines:
        raise DataError(f"{path} is empty; expected one sentence per line")
    return lines


def _load_multi30k_dir(directory: Path, src_lang: str, tgt_lang: str) -> datasets.DatasetDict:
    expected = "{train,val,test_2016_flickr}.{lang}[.gz]"
    if not directory.is_dir():
        raise DataError(
            f"local_dir {directory} is not a directory; expected raw Multi30k files {expected}"
        )
    if not any(directory.glob("train.*")):
        raise DataError(
            f"no training files train.{{lang}}[.gz] in {directory}; expected {expected}"
        )
    for lang in (src_lang, tgt_lang):
        if not any(_find_file(directory, stem, lang) for stem in MULTI30K_STEMS.values()):
            available = available_local_languages(directory)
            raise DataError(f"language {lang!r} not found in {directory}; available: {available}")
    # Check that every file exists before reading any, so one message names all that are missing.
    paths = {
        (split, lang): _find_file(directory, stem, lang)
        for split, stem in MULTI30K_STEMS.items()
        for lang in (src_lang, tgt_lang)
    }
    missing = [
        f"{MULTI30K_STEMS[split]}.{lang}[.gz]" for (split, lang), path in paths.items() if not path
    ]
    if missing:
        raise DataError(
            f"missing files in {directory}: {', '.join(missing)}; expected layout {expected}"
        )
    out = {}
    for split in MULTI30K_STEMS:
        src_path, tgt_path = paths[split, src_lang], paths[split, tgt_lang]
        src, tgt = read_lines(src_path), read_lines(tgt_path)
        if len(src) != len(tgt):
            longer = src if len(src) > len(tgt) else tgt
            trailing = next((i for i, line in enumerate(reversed(longer)) if line), len(longer))
            hint = (
                f" (the longer file ends with {trailing} empty line(s))"
                if trailing >= abs(len(src) - len(tgt))
                else ""
            )
            raise DataError(
                f"line counts differ: {src_path} has {len(src)} lines, {tgt_path} has "
                f"{len(tgt)}{hint}; expected line i of one to translate line i of the other"
            )
        out[split] = datasets.Dataset.from_dict({"src": src, "tgt": tgt}, features=FEATURES)
    logger.info(
        "loaded %s %s-%s: %s",
        directory,
        src_lang,
        tgt_lang,
        {split: len(ds) for split, ds in out.items()},
    )
    return datasets.DatasetDict(out)


def filter_parallel_dataset(
    dataset: datasets.DatasetDict, max_length: int | None = 100
) -> tuple[datasets.DatasetDict, dict[str, FilterStats]]:
    """Drop empty and over-long pairs from :data:`FILTERED_SPLITS`; others pass unchanged.

    A pair is empty when either side is empty or whitespace only, and over-long when either
    side has more than ``max_length`` whitespace-separated words (words, not characters or
    subwords, so the rule does not depend on the tokenizer). The test split is left alone so
    BLEU always uses the complete reference set.

    Args:
        dataset: Splits with ``src`` and ``tgt`` string columns.
        max_length: Maximum words per side; ``None`` disables the length filter.

    Returns:
        The filtered ``DatasetDict`` and a ``FilterStats`` for every filtered split. Empty
        pairs left in an unfiltered split are counted in a warning.

    Raises:
        DataError: Filtering left a split without any pair.
    """
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be a positive number of words or None, got {max_length}")
    out = dict(dataset)
    stats = {}
    for split in FILTERED_SPLITS:
        if split not in dataset:
            continue
        ds = dataset[split]
        keep, empty, too_long = [], 0, 0
        for i, (src, tgt) in enumerate(zip(ds["src"], ds["tgt"], strict=True)):
            if not src.strip() or not tgt.strip():
                empty += 1
            elif max_length is not None and (
                len(src.split()) > max_length or len(tgt.split()) > max_length
            ):
                too_long += 1
            else:
                keep.append(i)
        if len(keep) < len(ds):
            ds = ds.select(keep).flatten_indices()
        out[split] = ds
        stats[split] = FilterStats(
            split=split, total=len(keep) + empty + too_long, empty=empty, too_long=too_long
        )
        logger.info(
            "filtered %s: kept %d of %d pairs (%d empty, %d longer than %s words)",
            split,
            len(keep),
            stats[split].total,
            empty,
            too_long,
            max_length,
        )
        if not keep:
            raise DataError(
                f"no {split} pairs left: all {stats[split].total} were dropped ({empty} with an "
                f"empty side, {too_long} longer than max_length={max_length} words); expected "
                "at least one usable pair"
            )
    for split in sorted(set(dataset) - set(FILTERED_SPLITS)):
        ds = dataset[split]
        empty = sum(
            not s.strip() or not t.strip() for s, t in zip(ds["src"], ds["tgt"], strict=True)
        )
        if empty:
            logger.warning(
                "%s has %d of %d pairs with an empty side; kept, since %s is not filtered",
                split,
                empty,
                len(ds),
                split,
            )
    return datasets.DatasetDict(out), stats


def content_hash(dataset: datasets.Dataset | datasets.DatasetDict) -> str:
    """A SHA-256 of the ``src``/``tgt`` text (and split names), stable across processes."""
    digest = hashlib.sha256()
    parts = dataset.items() if isinstance(dataset, datasets.DatasetDict) else [("", dataset)]
    for split, ds in sorted(parts):
        digest.update(f"[{split}:{len(ds)}]".encode())
        for column in ("src", "tgt"):
            for text in ds[column]:
                encoded = text.encode("utf-8")
                digest.update(len(encoded).to_bytes(4, "little"))
                digest.update(encoded)
    return digest.hexdigest()
