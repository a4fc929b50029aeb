"""scripts/evaluate.py: prints BLEU and writes the hypotheses into Hydra's run directory;
a user error ends the process with one line, a key that no code reads too. Scoring itself
is tested in tests/evaluation/test_scoring.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from helpers.scripts import assert_one_error_line, run_script, script_module
from helpers.training import compose_config


def test_evaluate_prints_bleu(smoke_run_dir, tmp_path, multi30k_dir, monkeypatch, capsys) -> None:
    script = script_module("evaluate.py")
    run = SimpleNamespace(runtime=SimpleNamespace(output_dir=str(tmp_path)))
    monkeypatch.setattr(script, "HydraConfig", SimpleNamespace(get=lambda: run))
    cfg = compose_config(
        "evaluate",
        [
            f"ckpt={smoke_run_dir / 'checkpoints' / 'last.ckpt'}",
            "limit=5",
            "beam_size=1",
            f"data.local_dir={multi30k_dir}",
        ],
    )
    script.main(cfg)
    assert "BLEU" in capsys.readouterr().out
    assert len((tmp_path / "hypotheses.test.txt").read_text().splitlines()) == 5


@pytest.mark.slow  # the wrapper's wiring; the message in-process: test_io.py
def test_an_error_is_one_line_in_a_process(tmp_path) -> None:
    result = run_script("evaluate.py", "ckpt=/nonexistent/x.ckpt", f"hydra.run.dir={tmp_path}")
    line = assert_one_error_line(result, "checkpoint not found: /nonexistent/x.ckpt")
    assert result.stderr.strip().splitlines()[-1] == line


def test_evaluate_refuses_a_key_that_no_code_reads(tmp_path) -> None:
    """The same callback in every script's config (tests/training/test_configs.py checks
    that they all have it): ``limitt`` would have scored the whole split."""
    result = run_script("evaluate.py", "ckpt=none.ckpt", "++limitt=4", f"hydra.run.dir={tmp_path}")
    assert_one_error_line(result, "++limitt=4 sets limitt, which no code reads (closest: limit)")
    assert not any(tmp_path.iterdir())
