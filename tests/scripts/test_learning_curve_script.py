"""scripts/learning_curve.py refuses to write over a curve, in one line, and leaves it.

The curve itself, and a run without minute checkpoints, are tested in
tests/analysis/test_learning_curve.py.
"""

from __future__ import annotations

from helpers.scripts import assert_one_error_line, run_script


def test_refuses_to_write_over_a_curve(smoke_run_dir, tmp_path) -> None:
    curve = tmp_path / "curve"
    curve.mkdir()
    (curve / "learning_curve.md").write_text("| minutes | step | BLEU |\n")
    before = (curve / "learning_curve.md").read_bytes()
    result = run_script("learning_curve.py", f"run={smoke_run_dir}", f"out={curve}", "limit=8")
    assert_one_error_line(result, "already holds learning_curve.md")
    assert (curve / "learning_curve.md").read_bytes() == before
