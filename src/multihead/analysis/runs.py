"""Finished runs as the comparison reads them: their records on disk or in wandb, labelled,
sorted and grouped by seed.

A run directory is any directory holding a ``summary.json`` (what training wrote at its
end); beside it, ``csv/metrics.csv`` gives the validation curves, and ``speed.json`` the
side-by-side speeds ``compare.py speed=true`` measured (:func:`write_speed_record`). A wandb
group is read through the public API instead.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multihead.wandb_setup import has_wandb_api_key

SUMMARY_FILE = "summary.json"
SPEED_FILE = "speed.json"  # side-by-side speeds: {"speeds": {key: value}, "setup": {...}}
CURVE_KEYS = ("val/bleu", "val/loss")
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

    def get(self, key: str) -> Any:
        return self.summary.get(key)

    @property
    def seed(self) -> Any:
        return self.summary.get("seed")


# ---------------------------------------------------------------------------------------
# Reading runs


def find_run_dirs(root: str | os.PathLike) -> list[Path]:
    """Every directory at or below ``root`` that holds a ``summary.json``, sorted."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(
            f"runs={root}: no such directory (expected a multirun or run directory "
            f"containing {SUMMARY_FILE} files)"
        )
    dirs = sorted({p.parent for p in root.rglob(SUMMARY_FILE) if p.is_file()})
    if not dirs:
        raise FileNotFoundError(
            f"runs={root}: no {SUMMARY_FILE} found below it (expected the directory of "
            "finished training runs, e.g. outputs/train/multiruns/<time>)"
        )
    return dirs


def read_metrics_csv(path: str | os.PathLike) -> dict:
    """``{key: [(step, value), ...]}`` from a Lightning CSVLogger ``metrics.csv``."""
    with open(path, newline="") as f:
        return curves_from_rows(csv.DictReader(f), step_key="step")


def curves_from_rows(rows: Iterable[dict[str, Any]], step_key: str = STEP_KEY) -> dict[str, Curve]:
    """``{key: [(step, value), ...]}`` of CURVE_KEYS by step, from metrics.csv or wandb rows.

    Rows are sparse (each logging call writes its own row), so empty cells are skipped.
    """
    curves: dict[str, Curve] = {}
    for row in rows:
        step = number(row.get(step_key, row.get("_step")))
        for key in CURVE_KEYS:
            value = number(row.get(key))
            if step is not None and value is not None:
                curves.setdefault(key, []).append((int(step), value))
    return {key: sorted(points) for key, points in curves.items()}


def load_local_runs(root: str | os.PathLike) -> list[RunResult]:
    """Every run below ``root`` (see ``find_run_dirs``): its ``summary.json``, from
    ``csv/metrics.csv`` its validation curves and from ``speed.json`` its side-by-side
    speeds, where it has them; labelled and sorted."""
    runs = []
    for run_dir in find_run_dirs(root):
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
    """The config Hydra saved in ``run_dir/.hydra``, as written (unresolved); ``None``
    without one."""
    saved = run_dir / ".hydra" / "config.yaml"
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
            for key in CURVE_KEYS:  # one call per key: history(keys=...) keeps rows with all keys
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


# ---------------------------------------------------------------------------------------
# Seeds: runs that share a run name


def has_repeats(runs: list[RunResult]) -> bool:
    """Whether some configuration (run name) was run more than once, e.g. with two seeds."""
    names = [run.get("run_name") for run in runs]
    return len(set(names)) < len(names)


# Config keys in which the seeds of one configuration may differ: a seed at any level, and
# where a run reads and writes (any *dir or *dirpath, the loggers, its wandb group, a resume;
# wandb keeps the config resolved, so these name each run's own directory there).
NOT_THE_CONFIGURATION = ("ckpt_path", "wandb_group")
NOT_THE_CONFIGURATION_PREFIXES = ("logger.",)


def _not_the_configuration(key: str) -> bool:
    leaf = key.rsplit(".", 1)[-1]
    return (
        leaf == "seed"
        or leaf.endswith(("dir", "dirpath"))
        or key in NOT_THE_CONFIGURATION
        or key.startswith(NOT_THE_CONFIGURATION_PREFIXES)
    )


def check_seed_configs(runs: list[RunResult], pool_despite: Sequence[str] = ()) -> list[str]:
    """Refuse to pool runs that share a run name (seeds of one configuration) but whose
    configs differ in anything but a seed and where they read and write
    (:data:`NOT_THE_CONFIGURATION`), naming the first key that differs. Runs without a
    kept config (``.hydra/config.yaml``, wandb's) are not checked.

    Keys in ``pool_despite`` may differ too: the user's word that they do not change the
    run, say a key a later commit added whose default is the old behaviour. The keys that
    did differ are returned, for the report to name."""
    despite = set()
    for name, group in seed_groups(runs).items():
        kept = [run for run in group if run.config is not None]
        if len(kept) < 2:
            continue
        first = _flat(kept[0].config)
        for run in kept[1:]:
            other = _flat(run.config)
            for key in sorted(first.keys() | other.keys()):
                if _not_the_configuration(key) or first.get(key) == other.get(key):
                    continue
                if key in pool_despite:
                    despite.add(key)
                    continue
                raise ValueError(
                    f"runs {kept[0].source} and {run.source} share the run name {name!r} but "
                    f"their configs differ in {key} ({first.get(key)!r} against "
                    f"{other.get(key)!r}): runs of one name are pooled as seeds of one "
                    "configuration; compare runs that differ in their seed alone, or name "
                    "the key in pool_despite if it does not change the run"
                )
    return sorted(despite)


def refuse_unused_pool_despite(pool_despite: Sequence[str], differed: Sequence[str]) -> None:
    """Refuse keys of ``pool_despite`` in which no seeds of one run name differed
    (``differed``, what :func:`check_seed_configs` returned): a misspelt key pools nothing
    and would otherwise pass unseen."""
    unused = [key for key in pool_despite if key not in differed]
    if unused:
        raise ValueError(
            f"pool_despite names {', '.join(unused)}, but no seeds of one run name differ "
            "in it: expected config keys whose values differ between seeds (a misspelt key?)"
        )


def pooled_despite_note(keys: Sequence[str]) -> str:
    """The report's sentence on seeds pooled although their configs differ in ``keys``."""
    if not keys:
        return ""
    return (
        f"\n\nSeeds of one run name are pooled although their configs differ in "
        f"{', '.join(keys)} (pool_despite: the user's word that these keys do not change "
        "the run)."
    )


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``config``'s leaves by dotted key (``attention.design_options.cap``)."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def seed_groups(runs: list[RunResult]) -> dict[str, list[RunResult]]:
    """The runs by run name, in the order of ``runs``."""
    groups: dict[str, list[RunResult]] = {}
    for run in runs:
        groups.setdefault(str(run.get("run_name") or run.label), []).append(run)
    return groups


def seed_means(runs: list[RunResult]) -> list[RunResult]:
    """One result per run name whose numeric figures are the means over its runs.

    Text figures are the first run's; ``<BLEU key>_min``, ``<BLEU key>_max`` (for the run's
    own test BLEU and the hypotheses' BLEU) and ``seeds`` say how far the runs spread. A
    numeric figure some runs lack (side-by-side speeds of runs not measured) is the mean
    over the runs that have it.
    """
    means = []
    for name, group in seed_groups(runs).items():
        summary = {}
        for run in reversed(group):  # the first run's text figures win
            summary.update(run.summary)
        for key in summary:
            numbers = [n for run in group if (n := number(run.get(key))) is not None]
            if not isinstance(summary[key], str) and numbers:
                summary[key] = statistics.fmean(numbers)
        for key in ("test/bleu", HYP_BLEU):
            bleus = [b for run in group if (b := number(run.get(key))) is not None]
            if bleus:
                summary[f"{key}_min"], summary[f"{key}_max"] = min(bleus), max(bleus)
        summary["seed"], summary["seeds"] = None, [run.seed for run in group]
        label = f"{name} ({len(group)} runs)" if len(group) > 1 else name
        means.append(
            RunResult(source=", ".join(run.source for run in group), summary=summary, label=label)
        )
    return means


def paired_baseline(run: RunResult, runs: list[RunResult]) -> RunResult | None:
    """The MHA run with ``run``'s seed and heads; ``None`` without one (or without a seed)."""
    base = mha_baseline(run, runs)
    if base is None or run.seed is None or base.seed != run.seed:
        return None
    return base


_BEAM_KEY = re.compile(r"decode/beam(\d+)_sentences_per_s")


def beam_key(summary: dict[str, Any]) -> str | None:
    """The summary key of beam-search speed, e.g. ``decode/beam5_sentences_per_s``."""
    return next((k for k in sorted(summary) if _BEAM_KEY.fullmatch(k)), None)


def value(run: RunResult, key: str) -> Any:
    """A figure of ``run`` by column key; ``None`` when missing."""
    if key == "beam":
        key = beam_key(run.summary) or ""
    return run.summary.get(key)


def is_mha(run: RunResult) -> bool:
    """Whether ``run`` is the plain MHA layer, the reference: kind ``mha`` with no head design
    or positional part in its decoder tag (``mha8``; not ``mha8-diff`` or ``mha8-alibi``,
    which are MHA-shaped designs compared with it). Runs without a tag go by kind."""
    tag = run.get("tag")
    return run.get("kind") == "mha" and (tag is None or tag == f"mha{run.get('num_heads')}")


def mha_baseline(run: RunResult, runs: list[RunResult]) -> RunResult | None:
    """The MHA run with ``run``'s number of heads, if any: the one with the same seed
    preferred (a paired comparison), then the one with the same backend.

    MHA runs themselves have no baseline: only the other kinds are compared with MHA.
    """
    if is_mha(run):
        return None
    candidates = [
        other for other in runs if is_mha(other) and other.get("num_heads") == run.get("num_heads")
    ]
    candidates.sort(key=lambda c: (c.seed != run.seed, c.get("backend") != run.get("backend")))
    return candidates[0] if candidates else None


def number(raw: Any) -> float | None:
    """``raw`` as a float, or ``None`` for missing, empty, non-numeric or NaN values."""
    if raw is None or raw == "" or isinstance(raw, bool):
        return None
    try:
        number = float(raw)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number
