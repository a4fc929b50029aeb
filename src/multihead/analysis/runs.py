"""The comparison's first stage, runs loaded: their records on disk or in wandb, labelled
and sorted, and the other files a comparison reads (the long-context benchmark's rows).

A run directory is any directory holding a ``summary.json`` (what training wrote at its
end); beside it, ``.hydra/config.yaml`` its config, ``csv/metrics.csv`` its curves (every
``val/`` and ``select/`` figure at each evaluation during training), and ``speed.json`` the
side-by-side speeds ``compare.py speed=true`` measured (:func:`write_speed_record`). A kept
record (``docs/long_context/runs``) holds the same files flat: ``config.yaml`` and
``metrics.csv`` beside ``summary.json``. A wandb group is read through the public API instead.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multihead.wandb_setup import has_wandb_api_key

SUMMARY_FILE = "summary.json"
SPEED_FILE = "speed.json"  # side-by-side speeds: {"speeds": {key: value}, "setup": {...}}
CURVE_KEYS = ("val/bleu", "val/loss")  # the translation runs' validation curves, plotted
CURVE_PREFIXES = ("val/", "select/")  # the figures kept at every evaluation: the curves
STEP_KEY = "trainer/global_step"  # Lightning's step, the ``step`` column of metrics.csv
KIND_ORDER = {"mha": 0, "gqa": 1, "mqa": 2, "mla": 3}
HYP_BLEU = "test/bleu_hypotheses"  # BLEU of the run's hypotheses, in the tests' metric

# A curve: (step, value) pairs sorted by step.
Curve = list[tuple[int, float]]


@dataclass
class RunResult:
    """One run: its ``summary.json`` figures and its validation curves.

    ``source`` says where it came from (a run directory or a wandb run path) and
    ``curve_source`` where the curves came from: ``csv``, ``wandb-api``
    or ``none``.
    """

    source: str
    summary: dict[str, Any]
    curves: dict[str, Curve] = field(default_factory=dict)
    curve_source: str = "none"
    label: str = ""
    directory: Path | None = None  # the run directory, for runs read from disk
    paired: Any = None  # a PairedResult against ``baseline``, the MHA run of its seed
    baseline: RunResult | None = None
    speed_setup: dict[str, Any] | None = None  # how its side-by-side speeds were measured
    config: dict[str, Any] | None = None  # the run's config (Hydra's, or wandb's), if kept
    design: str = ""  # what grouping names it: its run name, and a variant's keys if split

    def get(self, key: str) -> Any:
        return self.summary.get(key)

    @property
    def seed(self) -> Any:
        return self.summary.get("seed")


# ---------------------------------------------------------------------------------------
# Reading runs


def find_run_dirs(root: str | os.PathLike, option: str = "runs") -> list[Path]:
    """Every directory at or below ``root`` that holds a ``summary.json``, sorted."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(
            f"{option}={root}: no such directory (expected a multirun or run directory "
            f"containing {SUMMARY_FILE} files)"
        )
    dirs = sorted({p.parent for p in root.rglob(SUMMARY_FILE) if p.is_file()})
    if not dirs:
        raise FileNotFoundError(
            f"{option}={root}: no {SUMMARY_FILE} found below it (expected the directory of "
            "finished training runs, e.g. outputs/train/multiruns/<time>)"
        )
    return dirs


def read_metrics_csv(path: str | os.PathLike) -> dict:
    """``{key: [(step, value), ...]}`` from a Lightning CSVLogger ``metrics.csv``."""
    with open(path, newline="") as f:
        return curves_from_rows(csv.DictReader(f), step_key="step")


def curves_from_rows(rows: Iterable[dict[str, Any]], step_key: str = STEP_KEY) -> dict[str, Curve]:
    """``{key: [(step, value), ...]}`` of every ``val/`` and ``select/`` figure by step, from
    metrics.csv or wandb rows.

    Rows are sparse (each logging call writes its own row), so empty cells are skipped.
    """
    curves: dict[str, Curve] = {}
    for row in rows:
        step = number(row.get(step_key, row.get("_step")))
        for key in row:
            if not key.startswith(CURVE_PREFIXES):
                continue
            value = number(row.get(key))
            if step is not None and value is not None:
                curves.setdefault(key, []).append((int(step), value))
    return {key: sorted(points) for key, points in curves.items()}


def load_local_runs(root: str | os.PathLike, option: str = "runs") -> list[RunResult]:
    """Every run below ``root`` (see ``find_run_dirs``): its ``summary.json``, from
    ``csv/metrics.csv`` its validation curves and from ``speed.json`` its side-by-side
    speeds, where it has them; labelled and sorted. ``option``: the user's name for
    ``root``, for the errors."""
    runs = []
    for run_dir in find_run_dirs(root, option):
        try:
            summary = json.loads((run_dir / SUMMARY_FILE).read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{run_dir / SUMMARY_FILE}: not valid JSON ({err})") from None
        config = hydra_config(run_dir)
        if "seed" not in summary:  # runs from before summary.json recorded it
            summary["seed"] = None if config is None else config.get("seed")
        runs.append(
            RunResult(source=str(run_dir), summary=summary, directory=run_dir, config=config)
        )
        metrics_csv = run_dir / "csv" / "metrics.csv"
        if not metrics_csv.is_file():  # a kept record's, flat
            metrics_csv = run_dir / "metrics.csv"
        if metrics_csv.is_file():
            runs[-1].curves, runs[-1].curve_source = read_metrics_csv(metrics_csv), "csv"
        if (run_dir / SPEED_FILE).is_file():
            record = json.loads((run_dir / SPEED_FILE).read_text())
            runs[-1].summary.update(record["speeds"])
            runs[-1].speed_setup = record["setup"]
    return label_and_sort(runs, root=Path(root))


def write_speed_record(run: RunResult, speeds: dict[str, float], setup: dict[str, Any]) -> Path:
    """Write ``run``'s side-by-side speeds and how they were measured into its directory's
    ``speed.json`` (replacing an earlier one), and into ``run`` itself; returns the path."""
    if run.directory is None:
        raise ValueError(f"speed=true needs runs on disk (runs=PATH); {run.label} is {run.source}")
    path = run.directory / SPEED_FILE
    path.write_text(json.dumps({"speeds": speeds, "setup": setup}, indent=2) + "\n")
    run.summary.update(speeds)
    run.speed_setup = setup
    return path


def hydra_config(run_dir: Path) -> dict[str, Any] | None:
    """The config Hydra saved in ``run_dir/.hydra`` (or, in a kept record, beside its
    summary), as written (unresolved); ``None`` without one."""
    saved = run_dir / ".hydra" / "config.yaml"
    if not saved.is_file():
        saved = run_dir / "config.yaml"
    if not saved.is_file():
        return None
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(saved), resolve=False)


def load_wandb_group(group: str, project: str, entity: str | None = None) -> list[RunResult]:
    """The runs of a wandb group, through the public API (needs network and an API key)."""
    if os.environ.get("WANDB_MODE") in ("offline", "disabled") or not has_wandb_api_key():
        raise ValueError(
            f"group={group} reads runs from the wandb API, which needs an API key and "
            "WANDB_MODE unset or online; for offline runs use runs=PATH"
        )
    import wandb

    path = f"{entity}/{project}" if entity else project
    try:
        api_runs = list(wandb.Api().runs(path, filters={"group": group}))
        runs = []
        for api_run in api_runs:
            summary = {k: v for k, v in api_run.summary_metrics.items() if not k.startswith("_")}
            summary.setdefault("run_name", api_run.name)
            summary.setdefault("seed", api_run.config.get("seed"))
            rows = []
            keys = sorted({*CURVE_KEYS, *(k for k in summary if k.startswith(CURVE_PREFIXES))})
            for key in keys:  # one call per key: history(keys=...) keeps rows with all keys
                rows += api_run.history(keys=[STEP_KEY, key], pandas=False)
            run = RunResult(
                source=f"{path}/{api_run.id}", summary=summary, config=dict(api_run.config)
            )
            run.curves, run.curve_source = curves_from_rows(rows), "wandb-api"
            runs.append(run)
    except wandb.errors.CommError as err:
        raise ValueError(f"wandb API, project {path}: {err}") from None
    if not runs:
        raise ValueError(f"wandb project {path} has no runs in group {group!r}")
    return label_and_sort(runs)


def label_and_sort(runs: list[RunResult], root: Path | None = None) -> list[RunResult]:
    """Sort by heads, then K/V heads (MHA, GQA, MQA), backend; label runs by run_name.

    Runs sharing a run_name (seeds, repeated sweeps) get their directory appended.
    """

    def sort_key(run: RunResult):
        heads = number(run.get("num_heads"))
        kv = number(run.get("num_kv_heads"))
        return (
            heads if heads is not None else math.inf,
            KIND_ORDER.get(run.get("kind"), len(KIND_ORDER)),
            -kv if kv is not None else math.inf,
            str(run.get("backend") or ""),
            str(run.get("run_name") or ""),
            run.source,
        )

    runs = sorted(runs, key=sort_key)
    names = [str(run.get("run_name") or Path(run.source).name) for run in runs]
    for run, name in zip(runs, names, strict=True):
        run.label = name
        if names.count(name) > 1:
            where = Path(run.source)
            if root is not None and where.is_relative_to(root):
                where = where.relative_to(root)
            run.label = f"{name} [{where}]"
    return runs


_BEAM_KEY = re.compile(r"decode/beam(\d+)_sentences_per_s")


def beam_key(summary: dict[str, Any]) -> str | None:
    """The summary key of beam-search speed, e.g. ``decode/beam5_sentences_per_s``."""
    return next((k for k in sorted(summary) if _BEAM_KEY.fullmatch(k)), None)


def value(run: RunResult, key: str) -> Any:
    """A figure of ``run`` by column key; ``None`` when missing."""
    if key == "beam":
        key = beam_key(run.summary) or ""
    return run.summary.get(key)


def number(raw: Any) -> float | None:
    """``raw`` as a float, or ``None`` for missing, empty, non-numeric or NaN values."""
    if raw is None or raw == "" or isinstance(raw, bool):
        return None
    try:
        number = float(raw)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number


# ---------------------------------------------------------------------------------------
# The benchmark's rows


def read_long_context(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of ``scripts/benchmark_long_context.py --json``, checked in one line."""
    path = Path(path)
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(
            f"long_context={path}: expected the JSON file benchmark_long_context.py --json "
            f"writes ({type(err).__name__}: {err})"
        ) from None
    needed = {"design", "dtype", "context", "batch", "candidate", "ms"}
    if not isinstance(rows, list) or not all(
        isinstance(r, dict) and needed <= r.keys() for r in rows
    ):
        raise ValueError(
            f"long_context={path}: expected a list of rows with {', '.join(sorted(needed))} "
            "(benchmark_long_context.py --json)"
        )
    return rows


def read_speed_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows ``benchmark_long_context.py --checkpoints ... --json`` wrote (candidate
    ``trained``), for the LM's decoding section."""
    rows = json.loads(Path(path).read_text())
    if not isinstance(rows, list) or any(r.get("candidate") != "trained" for r in rows):
        raise ValueError(
            f"long_context={path}: expected the rows of benchmark_long_context.py "
            "--checkpoints (candidate 'trained')"
        )
    return rows
