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


MIT = "The MIT License\n\nPermission is hereby granted, free of charge, to any person ...\n"
BSD3 = (
    "Redistribution and use in source and binary forms, with or without modification, ...\n"
    "Neither the name of the copyright holder nor the names of its contributors may be used\n"
    "to endorse or promote products derived from this software without permission.\n"
)
PSF = "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2\n...\n"


def make_wheel(
    directory: Path,
    name: str,
    files: dict[str, str],
    version: str = "1.0",
    dist_info: dict[str, str] | None = None,
) -> dict:
    """A wheel ``{name}-{version}-py3-none-any.whl`` holding ``files`` (path -> text), and
    ``dist_info`` (file name -> text) in its ``.dist-info``, in ``directory``; returns its
    pin, as ``data.packages`` takes it."""
    path = directory / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        for file, text in sorted(files.items()):
            z.writestr(zipfile.ZipInfo(file, (2024, 1, 1, 0, 0, 0)), text)
        for file, text in sorted((dist_info or {}).items()):
            z.writestr(zipfile.ZipInfo(f"{info}/{file}", (2024, 1, 1, 0, 0, 0)), text)
        metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        z.writestr(zipfile.ZipInfo(f"{info}/METADATA", (2024, 1, 1, 0, 0, 0)), metadata)
        wheel = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        z.writestr(zipfile.ZipInfo(f"{info}/WHEEL", (2024, 1, 1, 0, 0, 0)), wheel)
        z.writestr(zipfile.ZipInfo(f"{info}/RECORD", (2024, 1, 1, 0, 0, 0)), "")
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"name": name, "version": version, "sha256": sha}


def tiny_corpus_wheels(directory: Path) -> list[dict]:
    """Two wheels. ``tinypkg``: 40 modules in 20 directories, an exact duplicate of one
    module in another directory, a near-duplicate of one module in every directory, a short
    file; MIT-licensed, with a BSD-3-Clause directory (``sub3``). ``halfpkg``: 20 modules
    in 20 directories (half the bytes), BSD-3-Clause with a Python licence beside it (as
    Django's wheel), and a licence file in a directory with no module (covers nothing)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for d in range(20):
        for m in range(2):
            files[f"tinypkg/sub{d}/mod{m}.py"] = module_text(100 * d + m)
        near = module_text(7).replace("Module 7.", f"Module 7, copy {d}.")
        files[f"tinypkg/sub{d}/near.py"] = near
    files["tinypkg/extra/dup.py"] = files["tinypkg/sub0/mod0.py"]
    files["tinypkg/short.py"] = "x = 1\n"
    files["tinypkg/sub3/LICENSE.txt"] = BSD3
    half = {f"halfpkg/part{d}/mod.py": module_text(5000 + d) for d in range(20)}
    half["halfpkg/static/vendor/LICENSE"] = MIT
    return [
        make_wheel(directory, "tinypkg", files, dist_info={"LICENSE": MIT}),
        make_wheel(directory, "halfpkg", half, dist_info={"LICENSE": BSD3, "LICENSE.python": PSF}),
    ]
