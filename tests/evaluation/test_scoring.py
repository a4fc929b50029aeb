"""Scoring a checkpoint: hypotheses and scores written, bad arguments and outputs refused.

The script (evaluate.py) is tested in tests/scripts/test_evaluate_script.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from multihead.evaluation import evaluate_checkpoint

from helpers.scripts import fails_in_one_line


def test_evaluate_writes_hypotheses_and_scores(smoke_run_dir, tmp_path, multi30k_dir) -> None:
    result = evaluate_checkpoint(
        str(smoke_run_dir / "checkpoints" / "last.ckpt"),
        tmp_path,
        split="test",
        beam_size=2,
        limit=12,
        local_dir=str(multi30k_dir),
    )
    lines = (tmp_path / "hypotheses.test.txt").read_text().splitlines()
    assert len(lines) == 12 == result["sentences"]
    assert json.loads((tmp_path / "scores.json").read_text())["bleu"] == result["bleu"]
    assert "nrefs:1|case:mixed" in result["bleu_signature"]


def test_an_unknown_split_is_refused(smoke_run_dir, tmp_path, capsys) -> None:
    ckpt = str(smoke_run_dir / "checkpoints" / "last.ckpt")
    line = fails_in_one_line(evaluate_checkpoint, capsys, ckpt, tmp_path, split="dev")
    assert "split='dev'; expected one of" in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def ckpt(smoke_run_dir, tmp_path) -> Path:
    path = tmp_path / "good.ckpt"
    shutil.copy(smoke_run_dir / "checkpoints" / "last.ckpt", path)
    return path


def test_unwritable_output_location(ckpt, tmp_path, capsys) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("precious")
    line = fails_in_one_line(evaluate_checkpoint, capsys, str(ckpt), blocker / "out")
    assert str(blocker) in line, line
    assert blocker.read_text() == "precious"
