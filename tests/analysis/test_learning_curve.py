"""BLEU against wall-clock minutes, from a run's minute checkpoints and its metrics CSV.

The script (learning_curve.py) is tested in tests/scripts/test_learning_curve_script.py.
"""

from __future__ import annotations

import shutil

from multihead.analysis.learning_curve import learning_curve
from multihead.evaluation import evaluate_checkpoint

from helpers.scripts import fails_in_one_line


def test_learning_curve_scores_minute_checkpoints(smoke_run_dir, tmp_path, multi30k_dir) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(smoke_run_dir / "csv", run / "csv")
    for minute, step in [(5, 10), (10, 20)]:
        shutil.copy(
            smoke_run_dir / "checkpoints" / f"step{step}.ckpt",
            run / "checkpoints" / f"minute{minute}-step{step}.ckpt",
        )
    validation, scored, _ = learning_curve(
        run, tmp_path / "curve", beam_size=2, limit=8, local_dir=str(multi30k_dir)
    )
    assert [(r["minutes"], r["step"]) for r in scored] == [(5, 10), (10, 20)]
    # Two validations (Lightning logs them at the step index before the update count).
    assert len(validation) == 2 and validation[0]["step"] < validation[1]["step"] <= 20
    assert all(r["minutes"] > 0 for r in validation)
    direct = evaluate_checkpoint(
        str(run / "checkpoints" / "minute10-step20.ckpt"),
        tmp_path / "direct",
        beam_size=2,
        limit=8,
        local_dir=str(multi30k_dir),
    )
    assert scored[1]["bleu"] == direct["bleu"] and scored[1]["bleu_lc_tok"] == direct["bleu_lc_tok"]
    for name in ("learning_curve.md", "learning_curve.csv", "learning_curve.png"):
        assert (tmp_path / "curve" / name).stat().st_size > 0
    table = (tmp_path / "curve" / "learning_curve.md").read_text()
    assert f"| 10 | 20 | {direct['bleu']:.2f} |" in table


def test_a_run_without_minute_checkpoints_says_where_it_looked(
    smoke_run_dir, tmp_path, capsys
) -> None:
    line = fails_in_one_line(learning_curve, capsys, smoke_run_dir, tmp_path / "x")
    assert "no checkpoints/minute*-step*.ckpt" in line and str(smoke_run_dir) in line, line
