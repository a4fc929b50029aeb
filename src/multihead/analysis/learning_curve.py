"""BLEU against wall-clock minutes for one run (scripts/learning_curve.py).

Two curves from what a run with the ``WallClock`` callback leaves behind:

- validation BLEU (as trained: greedy, cased) from ``csv/metrics.csv``, where every validation
  row carries ``time/elapsed_min``;
- test scores of the ``minute{M}-step{S}.ckpt`` checkpoints, each translated again here
  (beam search by default), cased sacreBLEU, chrF and lowercased tokenized BLEU.
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multihead.evaluation import evaluate_checkpoint

MINUTE_CKPT = re.compile(r"^minute(?P<minute>[0-9.]+)-step(?P<step>\d+)\.ckpt$")


@dataclass(frozen=True)
class MinuteCheckpoint:
    minute: float
    step: int
    path: Path


def minute_checkpoints(ckpt_dir: str | os.PathLike) -> list[MinuteCheckpoint]:
    """The ``minute{M}-step{S}.ckpt`` files in ``ckpt_dir``, earliest first."""
    found = []
    for path in Path(ckpt_dir).glob("minute*.ckpt"):
        match = MINUTE_CKPT.match(path.name)
        if match:
            found.append(MinuteCheckpoint(float(match["minute"]), int(match["step"]), path))
    return sorted(found, key=lambda c: c.minute)


def validation_curve(metrics_csv: str | os.PathLike) -> list[dict[str, float]]:
    """Rows ``{minutes, step, val/bleu, val/loss}`` from a CSVLogger file, in step order.

    A validation writes one row holding its metrics and ``time/elapsed_min``; rows without
    both (training logs) are skipped.
    """
    rows = []
    with open(metrics_csv, newline="") as f:
        for row in csv.DictReader(f):
            if row.get("time/elapsed_min") and row.get("val/bleu"):
                rows.append(
                    {
                        "minutes": float(row["time/elapsed_min"]),
                        "step": int(float(row["step"])),
                        "val/bleu": float(row["val/bleu"]),
                        "val/loss": float(row["val/loss"]) if row.get("val/loss") else None,
                    }
                )
    return sorted(rows, key=lambda r: r["step"])


def learning_curve(
    run_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    split: str = "test",
    beam_size: int = 5,
    batch_size: int = 128,
    limit: int | None = None,
    local_dir: str | None = None,
) -> tuple[list[dict[str, float]], list[dict[str, Any]], list[Path]]:
    """Score every minute checkpoint of ``run_dir`` and write the curve into ``out_dir``.

    Writes ``learning_curve.md``, ``learning_curve.csv`` and ``learning_curve.png``, and one
    ``minute{M}/`` directory of hypotheses and scores per checkpoint. Returns the validation
    rows, the checkpoint scores and the written paths.
    """
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    metrics_csv = run_dir / "csv" / "metrics.csv"
    if not metrics_csv.is_file():
        raise FileNotFoundError(
            f"run={run_dir}: no csv/metrics.csv (expected a run trained with logger=csv or "
            "logger=wandb_csv)"
        )
    ckpts = minute_checkpoints(run_dir / "checkpoints")
    if not ckpts:
        raise FileNotFoundError(
            f"run={run_dir}: no checkpoints/minute*-step*.ckpt (train with "
            "callbacks.wall_clock.save_at_minutes=[...], as experiment=multi30k_en_de does)"
        )
    validation = validation_curve(metrics_csv)
    scored = []
    for ckpt in ckpts:
        result = evaluate_checkpoint(
            str(ckpt.path),
            out_dir / f"minute{ckpt.minute:03g}",
            split=split,
            beam_size=beam_size,
            batch_size=batch_size,
            limit=limit,
            local_dir=local_dir,
        )
        scored.append({"minutes": ckpt.minute, "step": ckpt.step, **result})
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        _write_markdown(validation, scored, out_dir / "learning_curve.md", run_dir, split),
        _write_csv(scored, out_dir / "learning_curve.csv"),
        _plot(validation, scored, out_dir / "learning_curve.png", split, beam_size),
    ]
    return validation, scored, paths


def _write_markdown(validation, scored, path: Path, run_dir: Path, split: str) -> Path:
    beam = scored[0]["beam_size"]
    lines = [
        f"Run: `{run_dir}`. Minutes are wall clock from the start of the run (data preparation",
        "included).",
        "",
        f"Checkpoints saved at set minutes, {split} split, beam {beam}:",
        "",
        "| minutes | step | BLEU (cased) | BLEU (lc, tok) | chrF |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in scored:
        lines.append(
            f"| {row['minutes']:g} | {row['step']} | {row['bleu']:.2f} | "
            f"{row['bleu_lc_tok']:.2f} | {row['chrf']:.2f} |"
        )
    lines += [
        "",
        f"BLEU signature: `{scored[0]['bleu_signature']}`; lc, tok: hypotheses and references",
        "lowercased, Moses-normalised and tokenised, sacreBLEU `tokenize='none'`;",
        f"chrF signature: `{scored[0]['chrf_signature']}`.",
        "",
        "Validation during training (greedy, cased BLEU):",
        "",
        "| minutes | step | val BLEU | val loss |",
        "|---:|---:|---:|---:|",
    ]
    for row in validation:
        loss = "" if row["val/loss"] is None else f"{row['val/loss']:.3f}"
        lines.append(f"| {row['minutes']:.1f} | {row['step']} | {row['val/bleu']:.2f} | {loss} |")
    path.write_text("\n".join(lines) + "\n")
    return path


def _write_csv(scored, path: Path) -> Path:
    keys = ["minutes", "step", "bleu", "bleu_lc_tok", "chrf", "beam_size", "checkpoint"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(scored)
    return path


def _plot(validation, scored, path: Path, split: str, beam_size: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    if validation:
        ax.plot(
            [r["minutes"] for r in validation],
            [r["val/bleu"] for r in validation],
            color="0.6",
            label="validation, greedy, cased",
        )
    minutes = [r["minutes"] for r in scored]
    ax.plot(minutes, [r["bleu"] for r in scored], "o-", label=f"{split}, beam {beam_size}, cased")
    ax.plot(
        minutes,
        [r["bleu_lc_tok"] for r in scored],
        "s--",
        label=f"{split}, beam {beam_size}, lowercased tokenised",
    )
    ax.set_xlabel("wall-clock minutes")
    ax.set_ylabel("BLEU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
