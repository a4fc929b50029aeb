"""The core install (torch only): the layer and the model import without the training stack,
and the scripts, which need it, name the extra to install.

.ci/run also runs this file in a virtualenv holding only torch and ``pip install .``.
"""

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
# What the `train` extra installs (import names), and two things it brings along.
TRAINING_STACK = [
    "lightning",
    "pytorch_lightning",
    "hydra",
    "omegaconf",
    "datasets",
    "tokenizers",
    "sacrebleu",
    "sacremoses",
    "wandb",
    "matplotlib",
    "pandas",
]


def test_the_layer_and_the_model_import_none_of_the_training_stack() -> None:
    code = (
        "import sys, multihead, multihead.attention, multihead.model\n"
        "print(' '.join(sorted({name.split('.')[0] for name in sys.modules})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    loaded = set(done.stdout.split())
    assert "torch" in loaded and "multihead" in loaded
    assert loaded.isdisjoint(TRAINING_STACK), sorted(loaded & set(TRAINING_STACK))


def scripts_needing_the_extra() -> list[str]:
    return sorted(p.name for p in SCRIPTS.glob("*.py") if "multihead.cli" in p.read_text())


def test_only_the_attention_benchmarks_run_without_the_extra() -> None:
    torch_only = {p.name for p in SCRIPTS.glob("*.py")} - set(scripts_needing_the_extra())
    assert torch_only == {"benchmark_attention.py", "benchmark_heads.py"}
    for name in torch_only:
        text = (SCRIPTS / name).read_text()
        assert not any(f"import {m}" in text or f"from {m}" in text for m in TRAINING_STACK)


@pytest.mark.parametrize("script", scripts_needing_the_extra())
def test_a_script_without_the_extra_names_it_in_one_line(script, monkeypatch, capsys) -> None:
    # As if Lightning and Hydra were not installed (None in sys.modules makes an import fail).
    for name in ("lightning", "hydra"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "multihead.cli", raising=False)  # so its check runs again
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(SCRIPTS / script), run_name="__main__")
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: the scripts need the training extra (lightning, hydra")
    assert err[0].endswith("pip install 'multihead[train]'")
