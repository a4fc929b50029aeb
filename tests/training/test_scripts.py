"""evaluate.py, translate.py and average_checkpoints.py on a checkpoint trained here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from multihead.analysis.learning_curve import learning_curve
from multihead.checkpoints import load_trained_model, read_checkpoint
from multihead.checkpoints.averaging import average_checkpoints, recent_checkpoints
from multihead.evaluation import evaluate_checkpoint

from helpers.scripts import run_script


@pytest.fixture
def run_dir(smoke_run_dir: Path) -> Path:
    return smoke_run_dir


def test_checkpoint_is_self_contained(run_dir: Path) -> None:
    loaded = load_trained_model(run_dir / "checkpoints" / "last.ckpt")
    assert not loaded.model.training
    assert loaded.config["data"]["tgt_lang"] == "de"
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("Ein Hund.")) == "Ein Hund."


def test_evaluate_writes_hypotheses_and_scores(run_dir, tmp_path, multi30k_dir) -> None:
    result = evaluate_checkpoint(
        str(run_dir / "checkpoints" / "last.ckpt"),
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


def test_evaluate_script_prints_bleu(run_dir, tmp_path, multi30k_dir) -> None:
    result = run_script(
        "evaluate.py",
        f"ckpt={run_dir / 'checkpoints' / 'last.ckpt'}",
        "limit=5",
        "beam_size=1",
        f"data.local_dir={multi30k_dir}",
        f"hydra.run.dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "BLEU" in result.stdout
    assert len((tmp_path / "hypotheses.test.txt").read_text().splitlines()) == 5


def test_translate_script_reads_stdin(run_dir) -> None:
    result = run_script(
        "translate.py",
        f"ckpt={run_dir / 'checkpoints' / 'last.ckpt'}",
        "beam_size=2",
        stdin="A dog runs.\nTwo men are talking.\n",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(result.stdout.splitlines()) == 2


def test_translate_keeps_blank_lines_aligned(run_dir) -> None:
    result = run_script(
        "translate.py",
        f"ckpt={run_dir / 'checkpoints' / 'last.ckpt'}",
        "beam_size=1",
        "progress=false",
        stdin="A dog runs.\n\nTwo men are talking.\n   \n",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout.split("\n")[:-1]
    assert len(out) == 4 and out[1] == "" and out[3] == "" and out[0] and out[2]


def test_translate_streams_ten_thousand_lines_with_progress(run_dir) -> None:
    result = run_script(
        "translate.py",
        f"ckpt={run_dir / 'checkpoints' / 'last.ckpt'}",
        "beam_size=1",
        "max_len_a=0",
        "max_len_b=2",
        stdin="A dog runs.\n" * 10_000,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(result.stdout.splitlines()) == 10_000
    assert "10000 lines" in result.stderr  # tqdm's final count on stderr


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "no input lines"),
        (b"A dog.\ncaf\xe9 au lait\n", "line 2 is not UTF-8"),
        (b"A dog.\n" + b"word " * 3000 + b"\n", "line 2 has"),
    ],
)
def test_translate_bad_input_is_one_line(run_dir, tmp_path, content, message) -> None:
    path = tmp_path / "in.txt"
    path.write_bytes(content)
    result = run_script(
        "translate.py", f"ckpt={run_dir / 'checkpoints' / 'last.ckpt'}", f"input={path}"
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert message in result.stderr
    assert path.read_bytes() == content


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("evaluate.py", ["ckpt=/nonexistent/x.ckpt"], "checkpoint not found: /nonexistent/x.ckpt"),
        ("translate.py", ["ckpt=/nonexistent/x.ckpt"], "checkpoint not found"),
        ("evaluate.py", ["ckpt=CKPT", "split=dev"], "split='dev'; expected one of"),
        ("translate.py", ["ckpt=CKPT", "input=/nonexistent.txt"], "input file not found"),
    ],
)
def test_script_errors_are_one_line(script, args, message, run_dir, tmp_path) -> None:
    ckpt = str(run_dir / "checkpoints" / "last.ckpt")
    args = [a.replace("CKPT", ckpt) for a in args]
    result = run_script(script, *args, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert message in result.stderr


def test_foreign_checkpoint_is_rejected_and_left_alone(tmp_path) -> None:
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="is not a readable checkpoint"):
        read_checkpoint(bad)
    torch.save({"weights": torch.zeros(1)}, tmp_path / "foreign.ckpt")
    with pytest.raises(ValueError, match="is not a multihead checkpoint"):
        read_checkpoint(tmp_path / "foreign.ckpt")
    assert bad.read_bytes() == b"not a checkpoint"


def test_average_checkpoints(run_dir: Path, tmp_path: Path) -> None:
    paths = recent_checkpoints(run_dir / "checkpoints", last=2)
    assert [p.name for p in paths] == ["step10.ckpt", "step20.ckpt"]
    averaged = average_checkpoints(paths)
    a, b = (read_checkpoint(p)["state_dict"] for p in paths)
    key = "model.decoder_layers.0.self_attn.in_proj.weight"
    torch.testing.assert_close(averaged["state_dict"][key], (a[key] + b[key]) / 2)

    out = tmp_path / "avg.ckpt"
    result = run_script(
        "average_checkpoints.py", f"ckpt_dir={run_dir / 'checkpoints'}", "last=2", f"out={out}"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert load_trained_model(out).config == load_trained_model(paths[-1]).config
    before = out.read_bytes()
    again = run_script(
        "average_checkpoints.py", f"ckpt_dir={run_dir / 'checkpoints'}", "last=2", f"out={out}"
    )
    assert again.returncode == 2 and "already exists" in again.stderr
    assert out.read_bytes() == before


def test_recent_checkpoints_orders_every_step_named_file_by_step(tmp_path: Path) -> None:
    """Periodic saves, minute marks and the final step count; last.ckpt and best-* do not."""
    names = [
        "step900.ckpt", "step1000.ckpt", "minute105-step1004.ckpt", "step1100.ckpt",
        "step1123.ckpt", "last.ckpt", "best-step1000-bleu40.10.ckpt",
    ]  # fmt: skip
    for name in names:
        (tmp_path / name).touch()
    picked = [p.name for p in recent_checkpoints(tmp_path, last=4)]
    assert picked == ["step1000.ckpt", "minute105-step1004.ckpt", "step1100.ckpt", "step1123.ckpt"]


def test_average_named_checkpoints(run_dir: Path, tmp_path: Path) -> None:
    ckpts = run_dir / "checkpoints"
    out = tmp_path / "named.ckpt"
    arg = f"ckpts=[{ckpts / 'step10.ckpt'},{ckpts / 'step20.ckpt'}]"
    result = run_script("average_checkpoints.py", arg, f"out={out}")
    assert result.returncode == 0, result.stderr[-2000:]
    a, b = (torch.load(ckpts / f"step{n}.ckpt", weights_only=False) for n in (10, 20))
    named = read_checkpoint(out)
    for key, value in a["state_dict"].items():
        expected = (value + b["state_dict"][key]) / 2 if value.is_floating_point() else value
        torch.testing.assert_close(named["state_dict"][key], expected)
    # Weights only: the optimiser and loop states belonged to step20's run, not to the mean.
    assert "optimizer_states" not in named and "loops" not in named


@pytest.mark.parametrize(
    "args, message",
    [
        (["ckpt_dir=CKPTS", "ckpts=[CKPTS/step10.ckpt]"], "expected exactly one"),
        ([], "expected exactly one"),
        (["ckpts=[CKPTS/step10.ckpt,CKPTS/step999.ckpt]"], "checkpoint not found"),
        (["ckpts=[]"], "expected at least one"),
    ],
)
def test_average_checkpoints_bad_arguments(run_dir, tmp_path, args, message) -> None:
    out = tmp_path / "avg.ckpt"
    args = [a.replace("CKPTS", str(run_dir / "checkpoints")) for a in args]
    result = run_script("average_checkpoints.py", *args, f"out={out}")
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_learning_curve_scores_minute_checkpoints(run_dir, tmp_path, multi30k_dir) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "csv", run / "csv")
    for minute, step in [(5, 10), (10, 20)]:
        shutil.copy(
            run_dir / "checkpoints" / f"step{step}.ckpt",
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

    # The script refuses to write over a curve, and says where it looked.
    before = (tmp_path / "curve" / "learning_curve.md").read_bytes()
    again = run_script("learning_curve.py", f"run={run}", f"out={tmp_path / 'curve'}", "limit=8")
    assert again.returncode == 2 and "already holds learning_curve.md" in again.stderr
    assert (tmp_path / "curve" / "learning_curve.md").read_bytes() == before
    missing = run_script("learning_curve.py", f"run={run_dir}", f"out={tmp_path / 'x'}")
    assert missing.returncode == 2 and "no checkpoints/minute*-step*.ckpt" in missing.stderr
