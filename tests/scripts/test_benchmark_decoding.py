"""scripts/benchmark_decoding.py refuses bad options in one line, before loading anything
(its timing and profiling runs are tested in tests/deploy/test_export.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO_ROOT
from helpers.scripts import script_module

SCRIPT = REPO_ROOT / "scripts" / "benchmark_decoding.py"


@pytest.mark.slow  # a process; other bad options in-process below
def test_a_bad_option_fails_in_one_line_in_a_process(tmp_path) -> None:
    """The one subprocess: argparse's exit status and its last stderr line, as a shell sees
    them."""
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "missing.ckpt"), "--alternate", "-1"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.endswith("error: --alternate must be >= 1 rounds, got -1"), result.stderr


@pytest.mark.parametrize(
    "options, message",
    [
        (
            ["--against", "/nonexistent", "--alternate", "1"],
            "expected a source tree with src/multihead",
        ),
        (["--against", str(REPO_ROOT)], "--against needs --alternate N"),
    ],
)
def test_bad_options_fail_in_one_line(options, message, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), str(tmp_path / "missing.ckpt"), *options])
    with pytest.raises(SystemExit) as stop:
        script_module("benchmark_decoding.py").main()
    assert stop.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
