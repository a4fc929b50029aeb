"""No part of ``multihead`` imports one above it.

The parts are the subpackages and top-level modules of ``src/multihead``, in :data:`LAYERS`
from the bottom up. A part may import itself and the parts below it, never one above:
every ``import multihead...`` and ``from multihead... import`` (relative ones too, and
those inside functions) is read from the source with :mod:`ast`, without importing it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "multihead"

# Bottom first. "multihead" is the package's own __init__ (the layer's public names).
LAYERS = (
    "wandb_setup",  # wandb online/offline without prompts (standard library only)
    "host",  # the host's name, its CPU and the time (standard library only)
    "timing",  # every job once per round, in turn: the one timer of the speed figures (torch only)
    "packed",  # nn.Linear on a oneDNN-reordered weight, for CPU decoding (torch only)
    "attention",  # the reusable layer (torch only)
    "integrations",  # the layer in other libraries' models (each imports its own extra)
    "model",  # the Transformer, its factory and its decoding
    "data",  # corpus loading, tokenizer, batching, DataModule
    "checkpoints",  # read, write atomically, load for translation, resume, average, convert
    "deploy",  # CTranslate2 export and engine
    "evaluation",  # translate and score
    "training",  # what runs during fit
    "analysis",  # reports about runs (and the fit callback that draws them): never in training
    "cli",  # what the scripts share
    "multihead",
)


def module_name(path: Path, package: Path) -> str:
    """``src/multihead/data/batching.py`` -> ``multihead.data.batching``."""
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part(module: str) -> str:
    """The part of ``multihead`` a dotted module name belongs to."""
    names = module.split(".")
    return names[1] if len(names) > 1 else names[0]


def multihead_imports(path: Path, package: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every import of a ``multihead`` module anywhere in ``path``."""
    name = module_name(path, package)
    parent = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # from .x import y, relative to the importer's package
                base = parent[: len(parent) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            modules = [module]
            if module == "multihead":  # from multihead import data: a part, else a name
                modules = [
                    f"multihead.{a.name}" if a.name in LAYERS else module for a in node.names
                ]
        else:
            continue
        found += [(node.lineno, m) for m in modules if m.split(".")[0] == "multihead"]
    return found


def back_imports(package: Path) -> list[str]:
    """Every import in ``package`` of a part at or above the importer's own level."""
    problems = []
    for path in sorted(package.rglob("*.py")):
        importer = part(module_name(path, package))
        for line, module in multihead_imports(path, package):
            imported = part(module)
            if imported != importer and LAYERS.index(imported) > LAYERS.index(importer):
                where = path.relative_to(package.parent)
                problems.append(f"{where}:{line} ({importer}) imports {module} ({imported})")
    return problems


def test_every_part_of_the_package_has_a_layer_and_every_layer_a_part() -> None:
    parts = {part(module_name(path, PACKAGE)) for path in PACKAGE.rglob("*.py")}
    assert parts == set(LAYERS)


def test_no_part_imports_one_above_it() -> None:
    assert back_imports(PACKAGE) == []


def test_the_walk_finds_imports_inside_functions_and_relative_ones(tmp_path: Path) -> None:
    package = tmp_path / "multihead"
    (package / "model").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "model" / "__init__.py").write_text("from .transformer import Transformer\n")
    (package / "model" / "transformer.py").write_text(
        "import torch\n"
        "from multihead.attention import MultiHeadAttention\n"
        "\n"
        "def build():\n"
        "    from multihead.training.run import train\n"
        "    import multihead.data.batching\n"
        "    from .. import evaluation, __version__\n"
    )
    assert multihead_imports(package / "model" / "transformer.py", package) == [
        (2, "multihead.attention"),
        (5, "multihead.training.run"),
        (6, "multihead.data.batching"),
        (7, "multihead.evaluation"),
        (7, "multihead"),
    ]
    assert multihead_imports(package / "model" / "__init__.py", package) == [
        (1, "multihead.model.transformer")
    ]
    assert back_imports(package) == [
        "multihead/model/transformer.py:5 (model) imports multihead.training.run (training)",
        "multihead/model/transformer.py:6 (model) imports multihead.data.batching (data)",
        "multihead/model/transformer.py:7 (model) imports multihead.evaluation (evaluation)",
        "multihead/model/transformer.py:7 (model) imports multihead (multihead)",
    ]


@pytest.mark.parametrize(
    ("importer", "imported"),
    [("model", "attention"), ("checkpoints", "model"), ("training", "checkpoints")],
)
def test_the_real_package_imports_downwards(importer: str, imported: str) -> None:
    # The walk reads the real sources: a part that the code does import is found.
    sources = (PACKAGE / importer).rglob("*.py")
    found = {part(m) for path in sources for _, m in multihead_imports(path, PACKAGE)}
    assert imported in found


def test_using_a_checkpoint_does_not_import_lightning() -> None:
    """Evaluating, translating, exporting and analysing import neither Lightning nor, through
    it, ``torch._dynamo`` (seconds per script start); only training does."""
    code = (
        "import sys, multihead.cli, multihead.checkpoints, multihead.evaluation, "
        "multihead.deploy, multihead.analysis, multihead.data\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'lightning', 'pytorch_lightning'}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_the_layer_and_the_integrations_package_do_not_import_transformers() -> None:
    """``transformers`` (the ``hf`` extra) is imported by ``integrations.huggingface`` alone."""
    code = (
        "import sys, multihead, multihead.model, multihead.integrations\n"
        "print('transformers' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
