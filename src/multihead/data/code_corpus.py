"""A public corpus of long documents built on first use from pinned packages: Python source.

The long-context comparison needs documents longer than its context, more tokens than a run
reads, and held-out splits with nothing shared across them that stand for the whole corpus.
On a machine that reaches only the package registries, the corpus is built the way
``datasets`` downloads a Hub dataset on first use: ``pip download`` fetches pinned wheels,
checked against their SHA-256 (so the bytes are the same everywhere), and every ``.py`` file
of at least ``MIN_BYTES`` becomes one document.

Splits, by directory: a file's path is cut to its first three components (a deeper file goes
with its directory, ``sympy/physics/quantum``; a file two levels down alone,
``sympy/core/cache.py``). Within each package, those keys are taken in the order of their
hash into ``test`` (the scored held-out data) and ``validation`` (what a learning rate is
chosen on), each while it brings the split nearer ``HELD_OUT_PERCENT`` of the package's
bytes; the rest is ``train``. So every package is held out in proportion to its bytes.
Exact duplicates are dropped first; then any held-out file that near-duplicates one training
file: a line-set Jaccard >= ``NEAR_DUPLICATE``, or a containment (the share of the held-out
file's lines present in the training file) >= ``NEAR_DUPLICATE``, which catches a file
copied into a much larger one that Jaccard misses.

The result is three JSON-lines files and ``card.json``: packages, hashes, counts per split
and package, the dropped files and why, the files' own SHA-256, and every licence its files
carry, found in the wheels (a licence file covers its directory; one in ``*.dist-info`` the
whole package), read with ``datasets.load_dataset("json", ...)``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

VERSION = "python-packages-v2"
MIN_BYTES = 4096  # shorter files could not fill a window of the context
NEAR_DUPLICATE = 0.5  # line-set Jaccard or containment at which a held-out file is dropped
SPLITS = ("train", "validation", "test")
HELD_OUT_PERCENT = {"test": 5, "validation": 5}  # of each package's bytes, by directory
# A licence file, by its name (LICENSE, LICENSE.python, COPYING, license.txt, NOTICE, ...).
LICENCE_FILE = re.compile(r"^(licen[cs]e|copying|notice)", re.IGNORECASE)


@dataclass(frozen=True)
class Package:
    """A pinned wheel: ``name==version`` and its SHA-256 as PyPI lists it. Its licences are
    read from its files (:func:`licences`)."""

    name: str
    version: str
    sha256: str


PACKAGES = (
    Package("sympy", "1.13.3", "54612cf55a62755ee71824ce692986f23c88ffa77207b30c1368eda4a7060f73"),
    Package("Django", "5.1.4", "236e023f021f5ce7dee5779de7b286565fdea5f4ab86bae5338e3f7b69896cf0"),
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


def _identify(text: str) -> list[str]:
    """The SPDX identifiers of the licences in a licence file's text, by the clauses that
    tell them apart (a file may hold several: sympy's holds its own and its patches')."""
    found = []
    if "PYTHON SOFTWARE FOUNDATION LICENSE" in text.upper():
        # Python's whole stack (PSF, BeOpen, CNRI, CWI) is Python-2.0; PSF's alone, PSF-2.0.
        found.append("Python-2.0" if "BEOPEN" in text.upper() else "PSF-2.0")
    if "Permission is hereby granted, free of charge" in text:
        found.append("MIT")
    if "Redistribution and use in source and binary forms" in text:
        # The third clause: no endorsement by the names of the authors.
        found.append("BSD-3-Clause" if "to endorse or promote" in text else "BSD-2-Clause")
    return found or ["unidentified"]


def licences(wheel: Path, package: str, docs: list[dict[str, str]]) -> list[dict]:
    """Every licence file of ``wheel`` that covers a document of ``docs``: its path, its
    licences' identifiers (:func:`_identify`), what it covers (its directory; a ``*.dist-info`` file
    the whole package, ``""``), how many documents, its SHA-256."""
    found = []
    with zipfile.ZipFile(wheel) as z:
        for info in sorted(z.infolist(), key=lambda i: i.filename):
            directory, _, name = info.filename.rpartition("/")
            if not LICENCE_FILE.match(name):
                continue
            data = z.read(info)
            covers = "" if directory.endswith(".dist-info") else directory + "/"
            mine = [d for d in docs if d["package"] == package and d["path"].startswith(covers)]
            if mine:
                found.append({
                    "package": package, "file": info.filename, "covers": covers,
                    "licences": _identify(data.decode("utf-8", "replace")),
                    "documents": len(mine), "sha256": hashlib.sha256(data).hexdigest(),
                })  # fmt: skip
    return found


def _lines(text: str) -> set[str]:
    """The file's distinct non-trivial lines, stripped: what near-duplicates share."""
    return {s for line in text.splitlines() if len(s := line.strip()) > 8}


def _directory(path: str) -> str:
    return "/".join(path.split("/")[:3])


def _hash(key: str) -> int:
    return int(hashlib.sha256(key.encode()).hexdigest(), 16)


def held_out_directories(docs: list[dict[str, str]]) -> dict[str, str]:
    """``{directory: split}`` of the held-out directories: within each package, directories
    in the order of their hash, each into the first held-out split that it brings nearer
    ``HELD_OUT_PERCENT`` of the package's bytes."""
    sizes: dict[str, Counter] = {}
    for doc in docs:
        sizes.setdefault(doc["package"], Counter())[_directory(doc["path"])] += len(
            doc["text"].encode()
        )
    chosen = {}
    for directories in sizes.values():
        total, held = sum(directories.values()), dict.fromkeys(HELD_OUT_PERCENT, 0)
        for directory in sorted(directories, key=_hash):
            size = directories[directory]
            for split, percent in HELD_OUT_PERCENT.items():
                target = total * percent / 100
                if abs(held[split] + size - target) < abs(held[split] - target):
                    chosen[directory], held[split] = split, held[split] + size
                    break
    return chosen


def near_duplicate(text: str, train: list[tuple[str, set[str]]]) -> dict | None:
    """The first training file (``(path, lines)``) that ``text`` near-duplicates, as
    ``{reason, file, jaccard, containment}``, or ``None``: Jaccard of the line sets, or the
    share of ``text``'s lines in the training file, at least ``NEAR_DUPLICATE``."""
    mine = _lines(text)
    if not mine:
        return None
    for path, other in train:
        shared = len(mine & other)
        jaccard, containment = shared / len(mine | other), shared / len(mine)
        if max(jaccard, containment) >= NEAR_DUPLICATE:
            reason = "jaccard" if jaccard >= NEAR_DUPLICATE else "containment"
            return {"reason": reason, "file": path, "jaccard": round(jaccard, 4),
                    "containment": round(containment, 4)}  # fmt: skip
    return None


def split_documents(docs: list[dict[str, str]]) -> tuple[dict[str, list], dict]:
    """``({split: documents}, dropped)``: exact duplicates go, the split is by directory
    (:func:`held_out_directories`), and a held-out file near-duplicating a training file
    (:func:`near_duplicate`) goes; ``dropped`` counts them and lists the near-duplicates."""
    seen: set[str] = set()
    unique = []
    for doc in docs:
        digest = hashlib.sha256(doc["text"].encode()).hexdigest()
        if digest not in seen:
            seen.add(digest)
            unique.append(doc)
    held = held_out_directories(unique)
    splits: dict[str, list] = {split: [] for split in SPLITS}
    for doc in unique:
        splits[held.get(_directory(doc["path"]), "train")].append(doc)
    train = [(d["path"], _lines(d["text"])) for d in splits["train"]]
    near = []
    for split in HELD_OUT_PERCENT:
        kept = []
        for doc in splits[split]:
            found = near_duplicate(doc["text"], train)
            if found is None:
                kept.append(doc)
            else:
                near.append({"split": split, "path": doc["path"], **found})
        splits[split] = kept
    reasons = Counter(n["reason"] for n in near)
    dropped = {
        "exact_duplicates": len(docs) - len(unique),
        "near_duplicates_jaccard": reasons["jaccard"],
        "near_duplicates_containment": reasons["containment"],
        "near_duplicate_files": near,
    }
    return splits, dropped


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

    Returns a directory holding ``train.jsonl``, ``validation.jsonl``, ``test.jsonl`` and
    ``card.json``.
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
        wheels = {p.name: _wheel_path(tmp / "wheels", p) for p in packages}
        docs = [d for name, wheel in wheels.items() for d in _documents(wheel, name)]
        splits, dropped = split_documents(docs)
        kept = [d for split in SPLITS for d in splits[split]]
        build = tmp / "corpus"
        build.mkdir()
        card = {
            "version": VERSION,
            "packages": [asdict(p) for p in packages],
            "licences": [f for name, wheel in wheels.items() for f in licences(wheel, name, kept)],
            "min_bytes": MIN_BYTES,
            "held_out": ", ".join(f"{s} {n}%" for s, n in HELD_OUT_PERCENT.items())
            + " of each package's bytes, by directory (3 path components) in the order of "
            "their name's hash",
            "near_duplicate": f"line-set Jaccard or containment >= {NEAR_DUPLICATE}",
            "dropped": dropped,
        }
        card["licence_ids"] = sorted({i for f in card["licences"] for i in f["licences"]})
        for split in SPLITS:
            card[split] = {
                "documents": len(splits[split]),
                "bytes": sum(len(d["text"].encode()) for d in splits[split]),
                "packages": {
                    p.name: {
                        "documents": sum(d["package"] == p.name for d in splits[split]),
                        "bytes": sum(
                            len(d["text"].encode()) for d in splits[split] if d["package"] == p.name
                        ),
                    }
                    for p in packages
                },
                "sha256": _write_jsonl(build / f"{split}.jsonl", splits[split]),
            }
        (build / "card.json").write_text(json.dumps(card, indent=2) + "\n")
        build.rename(out)
    return out


def load_code_corpus(root: str | Path, cache_dir: str | Path):
    """The corpus built in ``root`` as a ``datasets.DatasetDict`` (``train``, ``validation``,
    ``test``; columns ``text``, ``package``, ``path``), ``datasets``' own files under
    ``cache_dir``."""
    import datasets

    root = Path(root)
    files = {split: str(root / f"{split}.jsonl") for split in SPLITS}
    return datasets.load_dataset("json", data_files=files, cache_dir=str(Path(cache_dir) / "hf"))
