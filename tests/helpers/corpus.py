"""A tiny corpus of pinned wheels, built here, for the long-document loader offline."""

from __future__ import annotations

import hashlib
import random
import zipfile
from pathlib import Path

NAMES = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta")


def module_text(seed: int, functions: int = 80) -> str:
    """A Python module of about 5 KB whose later functions reuse the earlier ones' names:
    what a model can predict only by reading back."""
    rng = random.Random(seed)
    names = [f"{rng.choice(NAMES)}_{rng.randrange(10**6)}" for _ in range(functions)]
    lines = [f'"""Module {seed}."""', "import math", ""]
    for i, name in enumerate(names):
        callee = names[rng.randrange(i)] if i else "math.sqrt"
        lines += [f"def {name}(x, y={i}):", f"    return {callee}(x + y) * {i}", ""]
    return "\n".join(lines) + "\n"


def make_wheel(directory: Path, name: str, files: dict[str, str], version: str = "1.0") -> dict:
    """A wheel ``{name}-{version}-py3-none-any.whl`` holding ``files`` (path -> text) in
    ``directory``; returns its pin, as ``data.packages`` takes it."""
    path = directory / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        for file, text in sorted(files.items()):
            z.writestr(zipfile.ZipInfo(file, (2024, 1, 1, 0, 0, 0)), text)
        metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        z.writestr(zipfile.ZipInfo(f"{info}/METADATA", (2024, 1, 1, 0, 0, 0)), metadata)
        wheel = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        z.writestr(zipfile.ZipInfo(f"{info}/WHEEL", (2024, 1, 1, 0, 0, 0)), wheel)
        z.writestr(zipfile.ZipInfo(f"{info}/RECORD", (2024, 1, 1, 0, 0, 0)), "")
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"name": name, "version": version, "sha256": sha, "licence": "MIT"}


def tiny_corpus_wheels(directory: Path) -> list[dict]:
    """One wheel of 40 modules in 20 directories, an exact duplicate of one module in another
    directory, a near-duplicate of one module in every directory, and a short file."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for d in range(20):
        for m in range(2):
            files[f"tinypkg/sub{d}/mod{m}.py"] = module_text(100 * d + m)
        near = module_text(7).replace("Module 7.", f"Module 7, copy {d}.")
        files[f"tinypkg/sub{d}/near.py"] = near
    files["tinypkg/extra/dup.py"] = files["tinypkg/sub0/mod0.py"]
    files["tinypkg/short.py"] = "x = 1\n"
    return [make_wheel(directory, "tinypkg", files)]
