"""scripts/benchmark_decoding.py refuses bad options in one line, before loading anything
(its timing and profiling runs are tested in tests/deploy/test_export.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "benchmark_decoding.py"


@pytest.mark.parametrize(
    "options, message",
    [
        (["--alternate", "-1"], "--alternate must be >= 1 rounds, got -1"),
        (
            ["--against", "/nonexistent", "--alternate", "1"],
            "expected a source tree with src/multihead",
        ),
        (["--against", str(SCRIPT.parents[1])], "--against needs --alternate N"),
    ],
)
def test_bad_options_fail_in_one_line(options, message, tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "missing.ckpt"), *options],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert message in result.stderr.strip().splitlines()[-1]
