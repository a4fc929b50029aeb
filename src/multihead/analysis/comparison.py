"""Compare finished training runs: one table row per run, ratios against MHA, significance,
speeds, plots, and the same in wandb.

What ``scripts/compare.py`` does. Runs come from a directory (any directory below which run
directories hold a ``summary.json``, e.g. a Hydra multirun directory) or from a wandb group
through the public API. Validation curves are read from the run's ``csv/metrics.csv``
(written by default beside wandb, ``logger=wandb_csv``), or from wandb's public API for
a group of online runs.

Where the runs' test hypotheses are on disk (``hypotheses.test.txt`` in each run directory,
or another path relative to it), each run is tested against the MHA run of the same seed
with sacreBLEU's paired tests (:mod:`multihead.analysis.significance`), and the seeds of a
configuration give a mean paired difference with a Student-t interval. A run's own speeds
were measured during training: the report says whether runs overlapped in time on one host
(``run/start``, ``run/end``, ``run/host`` in ``summary.json``) and leaves such speeds out of
the plots unless they did not; ``speed=true`` measures every run again side by side
(:mod:`multihead.analysis.speed`).
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multihead.analysis.significance import (
    METRICS,
    TESTS,
    PairedResult,
    check_options,
    corpus_bleu,
    paired_tests,
    sacrebleu_seed,
    t_interval,
)
from multihead.analysis.speed import BEAM_KEY, GREEDY_KEY, TRAIN_KEY
from multihead.wandb_setup import configure_wandb_mode, finish_wandb, has_wandb_api_key

SUMMARY_FILE = "summary.json"
CURVE_KEYS = ("val/bleu", "val/loss")
STEP_KEY = "trainer/global_step"  # Lightning's step, the ``step`` column of metrics.csv
KIND_ORDER = {"mha": 0, "gqa": 1, "mqa": 2, "mla": 3}
OUTPUT_FILES = (
    "comparison.md",
    "comparison.csv",
    "bleu_vs_decode_speed.png",
    "bleu_vs_kv_cache.png",
    "validation_curves.png",
    "delta_vs_mha.png",
)
HYPOTHESES_FILE = "hypotheses.test.txt"
HYP_BLEU = "test/bleu_hypotheses"  # BLEU of the run's hypotheses, in the tests' metric
MISSING = "–"

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
    paired: PairedResult | None = None  # against ``baseline``, the MHA run of its seed
    baseline: RunResult | None = None

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
        step = _number(row.get(step_key, row.get("_step")))
        for key in CURVE_KEYS:
            value = _number(row.get(key))
            if step is not None and value is not None:
                curves.setdefault(key, []).append((int(step), value))
    return {key: sorted(points) for key, points in curves.items()}


def load_local_runs(root: str | os.PathLike) -> list[RunResult]:
    """Every run below ``root`` (see ``find_run_dirs``): its ``summary.json`` and, from
    ``csv/metrics.csv`` when there is one, its validation curves; labelled and sorted."""
    runs = []
    for run_dir in find_run_dirs(root):
        try:
            summary = json.loads((run_dir / SUMMARY_FILE).read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{run_dir / SUMMARY_FILE}: not valid JSON ({err})") from None
        if "seed" not in summary:  # runs from before summary.json recorded it
            summary["seed"] = hydra_seed(run_dir)
        runs.append(RunResult(source=str(run_dir), summary=summary, directory=run_dir))
        metrics_csv = run_dir / "csv" / "metrics.csv"
        if metrics_csv.is_file():
            runs[-1].curves, runs[-1].curve_source = read_metrics_csv(metrics_csv), "csv"
    return label_and_sort(runs, root=Path(root))


def hydra_seed(run_dir: Path) -> Any:
    """The ``seed`` of the config Hydra saved in ``run_dir/.hydra``; ``None`` without one."""
    saved = run_dir / ".hydra" / "config.yaml"
    if not saved.is_file():
        return None
    from omegaconf import OmegaConf

    return OmegaConf.load(saved).get("seed")


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
            run = RunResult(source=f"{path}/{api_run.id}", summary=summary)
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
        heads = _number(run.get("num_heads"))
        kv = _number(run.get("num_kv_heads"))
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
    figure missing from any run of a group is left as the first run's.
    """
    means = []
    for name, group in seed_groups(runs).items():
        summary = dict(group[0].summary)
        for key in summary:
            numbers = [_number(run.get(key)) for run in group]
            if not isinstance(summary[key], str) and None not in numbers:
                summary[key] = statistics.fmean(numbers)
        for key in ("test/bleu", HYP_BLEU):
            bleus = [b for run in group if (b := _number(run.get(key))) is not None]
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


def paired_deltas(group: list[RunResult], runs: list[RunResult], bleu_key: str) -> list[float]:
    """Per run of ``group`` that has a paired test, its Δ; otherwise its ``bleu_key`` BLEU
    minus that of the MHA run of the same seed and heads (runs without a seed pair with
    nothing)."""
    deltas = []
    for run in group:
        if run.paired is not None:
            deltas.append(run.paired.delta)
            continue
        base = paired_baseline(run, runs)
        mine = _number(run.get(bleu_key))
        theirs = _number(base.get(bleu_key)) if base is not None else None
        if mine is not None and theirs is not None:
            deltas.append(mine - theirs)
    return deltas


def verdict(low: float, high: float, p_value: float | None = None) -> str:
    """What an interval of a difference says: nothing detectable where it holds 0."""
    if low <= 0.0 <= high:
        return "no detectable difference"
    if p_value is None or p_value < 0.05:  # a t-interval without 0 is a two-sided p < 0.05
        return "p<0.05"
    return f"interval excludes 0, p={p_value:.3f}"


# ---------------------------------------------------------------------------------------
# Significance against MHA


def read_lines(path: Path) -> list[str]:
    """The lines of a text file, one per sentence (an empty line is an empty output)."""
    text = path.read_text(encoding="utf-8")
    return (text[:-1] if text.endswith("\n") else text).split("\n")


def run_data_config(run: RunResult) -> dict[str, Any] | None:
    """The ``data`` settings Hydra saved in the run's ``.hydra/config.yaml``, if any."""
    saved = run.directory / ".hydra" / "config.yaml" if run.directory else None
    if saved is None or not saved.is_file():
        return None
    from omegaconf import OmegaConf

    data = OmegaConf.load(saved).get("data") or {}
    keys = ("name", "src_lang", "tgt_lang", "local_dir", "test_limit")
    return {key: OmegaConf.select(data, key, default=None) for key in keys}


def load_references(
    runs: list[RunResult], references: str | None, local_dir: str | None = None
) -> tuple[list[str], str, Any]:
    """``(references, where from, target language)`` of the test split.

    ``references``: a file, one reference per line; ``None``: the test split named by the
    runs' saved data settings, loaded as ``scripts/evaluate.py`` loads it (all runs must
    name the same corpus and languages), from ``local_dir`` if given, else from the runs'
    ``data.local_dir``.
    """
    configs = [c for run in runs if (c := run_data_config(run)) is not None]
    lang = configs[0]["tgt_lang"] if configs else None
    if references is not None:
        path = Path(references)
        if not path.is_file():
            raise FileNotFoundError(
                f"references={references}: no such file; expected the test references, "
                "one per line, in the order of the hypotheses"
            )
        return read_lines(path), str(path), lang
    if not configs:
        raise ValueError(
            "references=null reads the test split named in the runs' .hydra/config.yaml, "
            "and no run has one; give references=FILE (one reference per line)"
        )
    corpora = {(c["name"], c["src_lang"], c["tgt_lang"]) for c in configs}
    if len(corpora) > 1:
        raise ValueError(
            f"the runs were tested on different corpora {sorted(corpora)}; compare runs of "
            "one corpus, or give references=FILE"
        )
    from multihead.data import load_parallel_dataset

    data = configs[0]
    split = load_parallel_dataset(
        name=data["name"],
        src_lang=data["src_lang"],
        tgt_lang=data["tgt_lang"],
        local_dir=local_dir if local_dir is not None else data["local_dir"],
    )["test"]
    refs = list(split["tgt"])[: data["test_limit"]]
    where = f"the test split of {data['name']} {data['src_lang']}-{data['tgt_lang']}"
    return refs, where, lang


def add_significance(
    runs: list[RunResult],
    *,
    hypotheses: str = HYPOTHESES_FILE,
    references: str | None = None,
    local_dir: str | None = None,
    test: str = "bs",
    metric: str = "lc-tok",
    samples: int = 0,
    lang: str | None = None,
) -> str:
    """Test every non-MHA run against the MHA run of its seed and heads, on the hypotheses
    at ``<run dir>/<hypotheses>``; set each run's ``paired``, ``baseline`` and ``HYP_BLEU``.

    Returns the paragraph that says how the tests were made, which runs had no partner,
    or why there are no tests.
    """
    check_options(test, metric, samples)
    outputs = {}
    for run in runs:
        if run.directory is not None and (run.directory / hypotheses).is_file():
            outputs[run.label] = read_lines(run.directory / hypotheses)
    if not outputs:
        return (
            f"No significance tests: no run has hypotheses at `<run dir>/{hypotheses}` "
            "(runs trained before they wrote them: score them with scripts/evaluate.py and "
            "give hypotheses=<its out dir>/hypotheses.test.txt)."
        )
    refs, where, config_lang = load_references(runs, references, local_dir)
    lang = lang or config_lang
    for run in runs:
        if run.label in outputs:
            if len(outputs[run.label]) != len(refs):
                raise ValueError(
                    f"{run.directory / hypotheses}: {len(outputs[run.label])} lines for "
                    f"{len(refs)} references ({where}); expected one hypothesis per test "
                    "sentence, in order"
                )
            run.summary[HYP_BLEU] = corpus_bleu(outputs[run.label], refs, metric, lang)
    by_baseline: dict[str, tuple[RunResult, list[RunResult]]] = {}
    unpaired = []
    for run in runs:
        if run.get("kind") == "mha" or run.label not in outputs:
            continue
        base = paired_baseline(run, runs)
        if base is None or base.label not in outputs:
            unpaired.append(run.label)
            continue
        by_baseline.setdefault(base.label, (base, []))[1].append(run)
    for base, systems in by_baseline.values():
        results = paired_tests(
            outputs[base.label],
            {run.label: outputs[run.label] for run in systems},
            refs,
            metric=metric,
            lang=lang,
            test=test,
            samples=samples,
        )
        for run in systems:
            run.paired, run.baseline = results[run.label], base
    tested = next((r.paired for r in runs if r.paired is not None), None)
    text = (
        f"BLEU here is **{metric}**: {METRICS[metric]}, of each run's `{hypotheses}` "
        f"({len(outputs)} of {len(runs)} runs have one) against {len(refs)} references "
        f"({where}). "
    )
    if tested is not None:
        text += (
            f"Each run is tested against the MHA run of its seed and heads by sacreBLEU's "
            f"{TESTS[test]} ({tested.samples} {'resamples' if test == 'bs' else 'trials'}, "
            f"SACREBLEU_SEED {sacrebleu_seed()}; `sacrebleu REF -i MHA RUN --paired-{test}` "
            "gives the same p). Δ is the run's BLEU minus MHA's; its 95% interval comes from "
            "the paired bootstrap resamples. **No detectable difference** wherever the "
            "interval holds 0."
        )
    if unpaired:
        text += f" No MHA run of the same seed with hypotheses for: {', '.join(unpaired)}."
    return text


def significance_markdown(runs: list[RunResult]) -> str:
    """The per-run table of paired tests against MHA."""
    headers = ["run", "MHA run", "seed", "BLEU", "MHA BLEU", "Δ", "95% interval", "p", "verdict"]
    rows = []
    for run in runs:
        if (r := run.paired) is None:
            continue
        rows.append(
            [
                run.label,
                run.baseline.label,
                str(run.seed),
                f"{r.score:.2f}",
                f"{r.baseline:.2f}",
                f"{r.delta:+.2f}",
                f"[{r.low:+.2f}, {r.high:+.2f}]",
                f"{r.p_value:.4f}",
                verdict(r.low, r.high, r.p_value),
            ]
        )
    return markdown_table(headers, rows) if rows else ""


# ---------------------------------------------------------------------------------------
# Speeds: measured during training, or side by side


def training_overlap(runs: list[RunResult]) -> tuple[str, str]:
    """``(status, sentence)``: whether runs trained at the same time on one host.

    ``status`` is ``overlap``, ``no overlap`` or ``unknown`` (some run's summary lacks
    ``run/start``, ``run/end`` or ``run/host``: runs from before summaries recorded them).
    """
    from datetime import datetime

    keys = ("run/start", "run/end", "run/host")
    lacking = [run.label for run in runs if any(not run.get(k) for k in keys)]
    if lacking:
        return "unknown", (
            f"Overlap unknown: {len(lacking)} of {len(runs)} runs do not record when and where "
            "they trained (run/start, run/end, run/host in summary.json), so their "
            "speeds measured during training may come from runs sharing the machine."
        )
    spans = [
        (
            run,
            datetime.fromisoformat(run.get("run/start")),
            datetime.fromisoformat(run.get("run/end")),
        )
        for run in runs
    ]
    pairs = [
        (a.label, b.label)
        for i, (a, a0, a1) in enumerate(spans)
        for b, b0, b1 in spans[i + 1 :]
        if a.get("run/host") == b.get("run/host") and a0 < b1 and b0 < a1
    ]
    if pairs:
        shown = "; ".join(f"{a} and {b}" for a, b in pairs[:5])
        more = f" and {len(pairs) - 5} more pairs" if len(pairs) > 5 else ""
        return "overlap", (
            f"**Runs overlapped in time on one host** ({shown}{more}): their speeds measured "
            "during training slowed each other and are not comparable."
        )
    return "no overlap", "No two runs trained at the same time on one host."


def speed_columns(runs: list[RunResult]) -> tuple[tuple[str, str, str], ...]:
    """The speed columns: the runs' own (measured during training), and the side-by-side
    measurement's when ``speed=true`` made one."""
    own = (
        ("train tgt tok/s (in training)", "perf/train_tgt_tokens_per_s", ",.0f"),
        ("greedy sent/s (in training)", "decode/greedy_sentences_per_s", ",.1f"),
        ("beam sent/s (in training)", "beam", ",.1f"),
    )
    if not any(run.get(GREEDY_KEY) is not None for run in runs):
        return own
    return own + (
        ("train tgt tok/s (side by side)", TRAIN_KEY, ",.0f"),
        ("greedy sent/s (side by side)", GREEDY_KEY, ",.1f"),
        ("beam sent/s (side by side)", BEAM_KEY, ",.1f"),
    )


def reported_speeds(runs: list[RunResult], overlap: str) -> dict[str, str] | None:
    """The speed keys the ratios and plots use: the side-by-side ones when measured, the
    runs' own when no runs overlapped, else ``None`` (no speed is worth plotting)."""
    if all(run.get(GREEDY_KEY) is not None for run in runs):
        return {"train": TRAIN_KEY, "greedy": GREEDY_KEY, "beam": BEAM_KEY, "as": "side by side"}
    if overlap == "no overlap":
        return {
            "train": "perf/train_tgt_tokens_per_s",
            "greedy": "decode/greedy_sentences_per_s",
            "beam": "beam",
            "as": "in training",
        }
    return None


# ---------------------------------------------------------------------------------------
# The table


# The table's columns: (header, summary key, format). The key ``beam`` means the
# decode/beam<k>_sentences_per_s key, whatever k is. The speeds follow (speed_columns).
COLUMNS = (
    ("kind", "kind", "s"),
    ("heads tag", "tag", "s"),
    ("heads", "num_heads", "d"),
    ("heads active", "heads/active_fraction", ".2f"),
    ("kv heads", "num_kv_heads", "d"),
    ("backend", "backend", "s"),
    ("params", "params/total", ",d"),
    ("attention params", "params/attention", ",d"),
    ("KV-cache bytes/token", "kv_cache/bytes_per_token", ",d"),
    ("peak MB", "perf/peak_memory_mb", ",.0f"),
    ("val BLEU", "val/bleu", ".2f"),
    ("test BLEU", "test/bleu", ".2f"),
)


def columns(report: Report) -> tuple[tuple[str, str, str], ...]:
    """COLUMNS, the speed columns, and the hypotheses' BLEU when the tests computed it."""
    runs = report.runs
    extra = ((f"test BLEU {report.metric} (hypotheses)", HYP_BLEU, ".2f"),)
    return COLUMNS + speed_columns(runs) + (extra if any(r.get(HYP_BLEU) for r in runs) else ())


def ratios(report: Report) -> tuple[tuple[str, str, str], ...]:
    """The ratios against MHA: (header, key, kind). Speeds only where they mean something."""
    found = [("KV-cache ×", "kv_cache/bytes_per_token", "ratio")]
    found.append(("attention params ×", "params/attention", "ratio"))
    if (speeds := report.speeds) is not None:
        found += [
            (f"train tok/s × ({speeds['as']})", speeds["train"], "ratio"),
            (f"greedy × ({speeds['as']})", speeds["greedy"], "ratio"),
            (f"beam × ({speeds['as']})", speeds["beam"], "ratio"),
        ]
    found.append((f"{report.bleu_name} Δ", report.bleu_key, "diff"))
    return tuple(found)


_BEAM_KEY = re.compile(r"decode/beam(\d+)_sentences_per_s")


def beam_key(summary: dict[str, Any]) -> str | None:
    """The summary key of beam-search speed, e.g. ``decode/beam5_sentences_per_s``."""
    return next((k for k in sorted(summary) if _BEAM_KEY.fullmatch(k)), None)


def value(run: RunResult, key: str) -> Any:
    """A figure of ``run`` by column key; ``None`` when missing."""
    if key == "beam":
        key = beam_key(run.summary) or ""
    return run.summary.get(key)


def mha_baseline(run: RunResult, runs: list[RunResult]) -> RunResult | None:
    """The MHA run with ``run``'s number of heads, if any: the one with the same seed
    preferred (a paired comparison), then the one with the same backend.

    MHA runs themselves have no baseline: only the other kinds are compared with MHA.
    """
    if run.get("kind") == "mha":
        return None
    candidates = [
        other
        for other in runs
        if other.get("kind") == "mha" and other.get("num_heads") == run.get("num_heads")
    ]
    candidates.sort(key=lambda c: (c.seed != run.seed, c.get("backend") != run.get("backend")))
    return candidates[0] if candidates else None


def ratio_row(run: RunResult, base: RunResult, spec) -> dict[str, float | None]:
    row = {}
    for header, key, kind in spec:
        mine, theirs = _number(value(run, key)), _number(value(base, key))
        if mine is None or theirs is None or (kind == "ratio" and theirs == 0):
            row[header] = None
        else:
            row[header] = mine / theirs if kind == "ratio" else mine - theirs
    return row


def format_cell(raw: Any, fmt: str) -> str:
    if raw is None or (isinstance(raw, float) and math.isnan(raw)):
        return MISSING
    if fmt == "s":
        return str(raw)
    number = _number(raw)
    if number is None:
        return str(raw)
    if fmt.endswith("d"):
        number = round(number)
    return format(number, fmt)


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass
class Report:
    """What the comparison's files say, worked out once: the runs, where they came from,
    which BLEU the headline figures use, the tests, the overlap and the speeds."""

    runs: list[RunResult]
    source: str
    significance: str = ""  # how the tests were made, or why there are none
    speed_setup: dict[str, Any] | None = None  # the side-by-side measurement's setup
    overlap: tuple[str, str] = ("unknown", "")
    bleu_key: str = "test/bleu"
    metric: str = ""  # the BLEU of the hypotheses (the tests' metric)

    @property
    def bleu_name(self) -> str:
        return f"test BLEU {self.metric} (hypotheses)" if self.bleu_key == HYP_BLEU else "test BLEU"

    @property
    def speeds(self) -> dict[str, str] | None:
        return reported_speeds(self.runs, self.overlap[0])

    @property
    def points(self) -> list[RunResult]:
        """What the plots and frontiers show: seed means when configurations repeat."""
        return seed_means(self.runs) if has_repeats(self.runs) else self.runs


def make_report(
    runs: list[RunResult], source: str, significance: str, speed_setup, metric: str
) -> Report:
    report = Report(runs, source, significance, speed_setup, training_overlap(runs))
    report.metric = metric
    if runs and all(run.get(HYP_BLEU) is not None for run in runs):
        report.bleu_key = HYP_BLEU
    return report


def seed_means_markdown(report: Report) -> str:
    """The headline section of ``comparison.md``: each configuration over its seeds, its
    paired Δ against MHA with a Student-t interval, and its verdict."""
    runs, key, speeds = report.runs, report.bleu_key, report.speeds
    headers = [
        "configuration",
        "runs",
        report.bleu_name,
        "min–max",
        "Δ vs MHA, paired (mean)",
        "95% t-interval",
        "Δ per seed",
        "verdict",
        "KV-cache bytes/token",
        "params",
    ]
    if speeds is not None:
        headers.append(f"train tgt tok/s ({speeds['as']})")
        headers += [f"{h} sent/s ({speeds['as']})" for h in ("greedy", "beam")]
    rows = []
    for (name, group), mean in zip(seed_groups(runs).items(), seed_means(runs), strict=True):
        deltas = paired_deltas(group, runs, key)
        interval = t_interval(deltas)
        low, high = mean.get(f"{key}_min"), mean.get(f"{key}_max")
        row = [
            name,
            str(len(group)),
            format_cell(mean.get(key), ".2f"),
            MISSING if low is None else f"{low:.2f}–{high:.2f}",
            format_cell(statistics.fmean(deltas) if deltas else None, "+.2f"),
            MISSING if interval is None else f"[{interval[1]:+.2f}, {interval[2]:+.2f}]",
            ", ".join(f"{d:+.2f}" for d in deltas) or MISSING,
            MISSING if interval is None else verdict(interval[1], interval[2]),
            format_cell(mean.get("kv_cache/bytes_per_token"), ",d"),
            format_cell(mean.get("params/total"), ",d"),
        ]
        if speeds is not None:
            row.append(format_cell(value(mean, speeds["train"]), ",.0f"))
            row += [format_cell(value(mean, speeds[k]), ",.1f") for k in ("greedy", "beam")]
        rows.append(row)
    return "\n".join(
        [
            "\n## Means over seeds\n",
            "Runs that share a run name are one configuration run with different seeds. "
            f"Δ is paired: each run's {report.bleu_name} minus that of the MHA run with the "
            "same seed and number of heads; the 95% interval of their mean is Student's t "
            "over the seeds (none with one seed). **No detectable difference** wherever it "
            "holds 0, p<0.05 otherwise. The plots and the frontiers use these means.\n",
            markdown_table(headers, rows),
        ]
    )


def comparison_markdown(report: Report) -> str:
    """The text of ``comparison.md``: notes on speeds, the runs table, ratios vs MHA, the
    tests, the seed means, plots and sources."""
    runs = report.runs
    cols = columns(report)
    headers = ["run"] + [h for h, _, _ in cols]
    rows = [[run.label] + [format_cell(value(run, k), f) for _, k, f in cols] for run in runs]
    parts = [f"# Run comparison\n\n{len(runs)} runs from `{report.source}`.\n", speed_note(report)]
    parts.append(markdown_table(headers, rows))

    beams = sorted({k for run in runs if (k := beam_key(run.summary))})
    if beams:
        parts.append(f"\nbeam sent/s (in training): `{'`, `'.join(beams)}`.")

    spec = ratios(report)
    ratio_lines = []
    for run in runs:
        base = mha_baseline(run, runs)
        if base is None:
            continue
        found = ratio_row(run, base, spec)
        ratio_lines.append(
            [run.label, base.label]
            + [format_cell(found[h], "+.2f" if kind == "diff" else ".2f") for h, _, kind in spec]
        )
    if ratio_lines:
        parts.append("\n## Against MHA with the same number of heads\n")
        parts.append(
            "× is this run's figure divided by the MHA run's (KV-cache below 1 is smaller, "
            "speed above 1 is faster); Δ is the difference in BLEU points.\n"
        )
        parts.append(markdown_table(["run", "MHA run"] + [h for h, _, _ in spec], ratio_lines))

    parts.append(f"\n## Significance against MHA of the same seed\n\n{report.significance}\n")
    if table := significance_markdown(runs):
        parts.append(table)
    if has_repeats(runs):
        parts.append(seed_means_markdown(report))
    parts.append(_frontier_lines(report))
    parts.append(
        "\n## Plots\n\n![test BLEU vs decoding speed](bleu_vs_decode_speed.png)\n\n"
        "![test BLEU vs KV-cache bytes per token](bleu_vs_kv_cache.png)\n\n"
        "![Δ BLEU against MHA with 95% intervals](delta_vs_mha.png)\n\n"
        "![validation curves](validation_curves.png)\n\n## Sources\n"
    )
    for run in runs:
        parts.append(f"- {run.label}: `{run.source}` (validation curves: {run.curve_source})")
    return "\n".join(parts) + "\n"


def speed_note(report: Report) -> str:
    """Above the table: where each speed column comes from and whether it means anything."""
    lines = [
        "Speeds marked *in training* are the runs' own, measured while each run trained. "
        + report.overlap[1]
    ]
    setup = report.speed_setup
    if setup is not None:
        lines.append(
            f"Speeds marked *side by side* were measured by `compare.py speed=true` in one "
            f"process, the runs interleaved ({setup['rounds']} rounds, medians): on "
            f"{setup['cpu']} ({setup['host']}), {setup['threads']} threads, torch "
            f"{setup['torch']}; decoding {setup['test_sentences']} test sentences with each "
            f"run's checkpoint (greedy and beam {setup['beam_size']}, batches of "
            f"{setup['batch_size']}), training fp32 steps over {setup['train_sentences']} "
            f"training sentences in batches of <= {setup['max_tokens']} tokens."
        )
    speeds = report.speeds
    if speeds is None:
        lines.append(
            "The plots and ratios leave the in-training speeds out; measure them side by "
            "side with `compare.py speed=true`."
        )
    else:
        lines.append(f"The plots and ratios use the speeds measured {speeds['as']}.")
    return "\n\n".join(lines) + "\n"


def _frontier_lines(report: Report) -> str:
    """The Pareto frontiers of test BLEU against KV-cache bytes and decoding speed."""
    lines = [f"\n## Pareto frontiers ({report.bleu_name} against ...)\n"]
    axes = [("kv_cache/bytes_per_token", "KV-cache bytes per token (fewer is better)")]
    if (speeds := report.speeds) is not None:
        axes.append((speeds["greedy"], f"greedy sentences/s, {speeds['as']} (more is better)"))
    for key, what in axes:
        frontier = pareto_frontier(
            report.points,
            key,
            lower_is_better=LOWER_IS_BETTER.get(key, False),
            bleu_key=report.bleu_key,
        )
        names = ", ".join(run.label for run in frontier) or "no runs with both figures"
        lines.append(f"- {what}: {names}")
    return "\n".join(lines) + "\n"


def table_rows(report: Report) -> tuple[list[str], list[list[Any]]]:
    """Every column, unformatted, the ratios vs MHA, the paired test and each run's source:
    the rows of ``comparison.csv`` and of the wandb table."""
    runs = report.runs
    cols, spec = columns(report), ratios(report)
    tests = ["paired Δ", "Δ low", "Δ high", "p", "verdict", "MHA run"]
    fields = ["run", *[h for h, _, _ in cols], *[h for h, _, _ in spec], *tests, "source"]
    rows = []
    for run in runs:
        row = [value(run, k) for _, k, _ in cols]
        base = mha_baseline(run, runs)
        found = ratio_row(run, base, spec) if base is not None else {}
        row += [found.get(h) for h, _, _ in spec]
        r = run.paired
        if r is None:
            row += [None] * len(tests)
        else:
            row += [r.delta, r.low, r.high, r.p_value, verdict(r.low, r.high, r.p_value)]
            row.append(run.baseline.label)
        rows.append([run.label, *row, run.source])
    return fields, rows


def write_csv(report: Report, path: Path) -> None:
    fields, rows = table_rows(report)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(fields)
        writer.writerows([["" if v is None else v for v in row] for row in rows])


# ---------------------------------------------------------------------------------------
# Plots


def pareto_frontier(
    runs: list[RunResult], key: str, *, lower_is_better: bool, bleu_key: str = "test/bleu"
) -> list[RunResult]:
    """The runs no other run beats on both test BLEU and ``key``, in ``key`` order (best
    first): a run is on the frontier when every run at least as good on ``key`` scores a
    lower BLEU."""
    points = [
        (x, y, run)
        for run in runs
        if (x := _number(value(run, key))) is not None
        and (y := _number(value(run, bleu_key))) is not None
    ]
    points.sort(key=lambda p: (p[0] if lower_is_better else -p[0], -p[1]))
    frontier, best = [], -math.inf
    for _, y, run in points:
        if y > best:
            frontier.append(run)
            best = y
    return frontier


# Which end of each plotted axis is better: fewer cache bytes, more sentences per second.
LOWER_IS_BETTER = {"kv_cache/bytes_per_token": True}


def plot_bleu_against(
    runs: list[RunResult],
    path: Path,
    panels: list[tuple[str, str]],
    bleu_key: str,
    ylabel: str,
    why: str = "",
) -> None:
    """Test BLEU against each ``(key, x label)`` of ``panels``: an annotated scatter each,
    with its Pareto frontier drawn as a step line. Without panels, ``why`` says why not."""
    import matplotlib.pyplot as plt

    panels = panels or [("", "")]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5), squeeze=False)
    for ax, (key, xlabel) in zip(axes[0], panels, strict=True):
        if not key:
            ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, wrap=True)
            continue
        for run in runs:
            x, y = _number(value(run, key)), _number(value(run, bleu_key))
            if x is not None and y is not None:
                ax.scatter([x], [y], color="C0")
                if (low := run.get(f"{bleu_key}_min")) is not None:  # a seed mean: its spread
                    high = run.get(f"{bleu_key}_max")
                    ax.errorbar([x], [y], yerr=[[y - low], [high - y]], color="C0", capsize=3)
                ax.annotate(
                    run.label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7
                )
        lower = LOWER_IS_BETTER.get(key, False)
        frontier = pareto_frontier(runs, key, lower_is_better=lower, bleu_key=bleu_key)
        if len(frontier) > 1:
            xs = [_number(value(run, key)) for run in frontier]
            ys = [_number(value(run, bleu_key)) for run in frontier]
            ax.step(xs, ys, where="post" if lower else "pre", color="C1", label="Pareto frontier")
            ax.legend(fontsize=7)
        if not ax.collections:
            _no_data(ax, f"test BLEU and {xlabel}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_deltas(report: Report, path: Path) -> None:
    """Δ BLEU against MHA per configuration: each seed's paired Δ with its bootstrap
    interval (when tested), and the mean over seeds with its Student-t interval."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = [
        (name, group)
        for name, group in seed_groups(report.runs).items()
        if paired_deltas(group, report.runs, report.bleu_key)
    ]
    for y, (_, group) in enumerate(groups):
        for k, run in enumerate(group):
            if (r := run.paired) is not None:
                err = [[r.delta - r.low], [r.high - r.delta]]
                offset = 0.4 * (k + 1) / (len(group) + 1)  # the seeds just below their mean
                ax.errorbar([r.delta], [y + offset], xerr=err, fmt=".", color="C0", capsize=2)
        deltas = paired_deltas(group, report.runs, report.bleu_key)
        if (interval := t_interval(deltas)) is not None:
            mean, low, high = interval
            ax.errorbar(
                [mean], [y], xerr=[[mean - low], [high - mean]], fmt="s", color="C1", capsize=4
            )
        else:
            ax.plot(deltas, [y] * len(deltas), "s", color="C1")
    if groups:
        ax.axvline(0.0, color="grey", lw=1)
        ax.set_yticks(range(len(groups)), [name for name, _ in groups], fontsize=7)
        ax.set_ylim(len(groups) - 0.5, -0.5)  # the first configuration on top
    else:
        _no_data(ax, "paired runs (an MHA run of the same seed and heads)")
    ax.set_xlabel(f"Δ {report.bleu_name} vs MHA of the same seed")
    ax.set_title("squares: mean over seeds, t 95%; dots: each seed, bootstrap 95%", fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what}", ha="center", va="center", transform=ax.transAxes)


def plot_validation_curves(runs: list[RunResult], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVE_KEYS), figsize=(6 * len(CURVE_KEYS), 4.5))
    for ax, key in zip(axes, CURVE_KEYS, strict=True):
        for run in runs:
            if curve := run.curves.get(key):
                ax.plot(*zip(*curve, strict=True), marker=".", label=run.label)
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            _no_data(ax, f"{key} history")
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.set_title(key)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------


def write_comparison(report: Report, out_dir: str | os.PathLike) -> list[Path]:
    """Write the files named in ``OUTPUT_FILES`` into ``out_dir`` (created if needed).

    Only those files are written; earlier copies of them are overwritten, nothing else in
    ``out_dir`` is touched. Returns their paths.
    """
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"out={out} is a file; expected a directory for the comparison")
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / name for name in OUTPUT_FILES]
    md, table, speed, kv, curves, deltas = paths
    md.write_text(comparison_markdown(report))
    write_csv(report, table)
    speeds = report.speeds
    panels = []
    if speeds is not None:
        panels = [
            (speeds["greedy"], f"greedy sentences/s ({speeds['as']})"),
            (speeds["beam"], f"beam sentences/s ({speeds['as']})"),
        ]
    why = (
        f"speeds measured in training left out\n(overlap: {report.overlap[0]})\n"
        "measure them with compare.py speed=true"
    )
    plot_bleu_against(report.points, speed, panels, report.bleu_key, report.bleu_name, why)
    kv_panel = [("kv_cache/bytes_per_token", "KV-cache bytes per token")]
    plot_bleu_against(report.points, kv, kv_panel, report.bleu_key, report.bleu_name)
    plot_validation_curves(report.runs, curves)
    plot_deltas(report, deltas)
    return paths


def log_to_wandb(
    report: Report, paths: list[Path], *, group: str | None, project: str, entity: str | None
) -> str:
    """Log the comparison to a wandb run of its own (job type ``comparison``) in ``group``:
    the table as a ``wandb.Table`` named ``comparison``, the plots as images. Offline
    without an API key, as training is. Returns the run's path or offline directory."""
    import wandb

    out = paths[0].parent
    configure_wandb_mode(str(out))
    run = wandb.init(
        project=project,
        entity=entity,
        group=group,
        name=f"comparison-{group}" if group else "comparison",
        job_type="comparison",
        dir=str(out),
        config={"source": report.source, "runs": len(report.runs), "bleu": report.bleu_name},
    )
    try:
        fields, rows = table_rows(report)
        cells = [
            [c if isinstance(c, (int, float)) or c is None else str(c) for c in row] for row in rows
        ]
        logged = {"comparison": wandb.Table(columns=fields, data=cells)}
        for path in paths:
            if path.suffix == ".png":
                logged[path.stem] = wandb.Image(str(path))
        run.log(logged)
        where = run.dir if run.settings.mode == "offline" else run.path
    finally:
        finish_wandb()
    return str(where)


def runs_wandb_group(runs: list[RunResult]) -> str | None:
    """The wandb group the runs were logged in, as each recorded it (``run/wandb_group`` in
    its summary), if they share one.

    Not read from the saved ``.hydra/config.yaml``: Hydra saves it unresolved, and a sweep's
    group (``${path_name:${hydra:sweep.dir}}``) resolves only inside the sweep's own jobs.
    """
    groups = {run.get("run/wandb_group") for run in runs} - {None}
    return groups.pop() if len(groups) == 1 else None


def compare(
    out: str | os.PathLike,
    runs: str | os.PathLike | None = None,
    group: str | None = None,
    project: str = "multihead",
    entity: str | None = None,
    *,
    hypotheses: str = HYPOTHESES_FILE,
    references: str | None = None,
    local_dir: str | None = None,
    significance: dict[str, Any] | None = None,
    speed: bool = False,
    speed_options: dict[str, Any] | None = None,
    checkpoint: str | None = None,
    wandb_log: bool = False,
    wandb_group: str | None = None,
) -> tuple[list[RunResult], list[Path]]:
    """Read the runs below ``runs`` or in wandb ``group`` and write the comparison to ``out``.

    ``significance``: the options of :func:`add_significance` (test, metric, samples, lang).
    ``local_dir``: where the raw corpus is (test references, speed); ``None``: the runs'.
    ``speed``: also measure every run side by side (:func:`multihead.analysis.speed.measure`
    with ``speed_options``), decoding each run's ``checkpoint`` (a path relative to the run
    directory; ``None``: the checkpoint its test used, ``test/ckpt``). ``wandb_log``: log
    the comparison to a wandb run of its own in ``wandb_group`` (``None``: ``group``, or
    the runs' own ``wandb_group``).
    """
    if (runs is None) == (group is None):
        raise ValueError(
            f"give exactly one of runs=PATH or group=NAME (got runs={runs}, group={group})"
        )
    if runs is not None:
        results, source = load_local_runs(runs), str(runs)
    else:
        results = load_wandb_group(group, project, entity)
        source = f"wandb {entity + '/' if entity else ''}{project}, group {group}"
    notes = add_significance(
        results,
        hypotheses=hypotheses,
        references=references,
        local_dir=local_dir,
        **(significance or {}),
    )
    setup = None
    if speed:
        from multihead.analysis.speed import measure

        checkpoints = {run.label: run_checkpoint(run, checkpoint) for run in results}
        measured, setup = measure(checkpoints, local_dir=local_dir, **(speed_options or {}))
        for run in results:
            run.summary.update(measured[run.label])
    metric = (significance or {}).get("metric", "lc-tok")
    report = make_report(results, source, notes, setup, metric)
    paths = write_comparison(report, out)
    if wandb_log:
        target = wandb_group or group or runs_wandb_group(results)
        log_to_wandb(report, paths, group=target, project=project, entity=entity)
    return results, paths


def run_checkpoint(run: RunResult, checkpoint: str | None) -> Path:
    """The checkpoint ``speed=true`` decodes for ``run``: ``checkpoint`` relative to the
    run directory, or the one its test used (``test/ckpt`` in its summary)."""
    if run.directory is None:
        raise ValueError(f"speed=true needs runs on disk (runs=PATH); {run.label} is {run.source}")
    if checkpoint is not None:
        path = run.directory / checkpoint
    elif isinstance(run.get("test/ckpt"), str) and run.get("test/ckpt") != "final weights":
        path = run.directory / run.get("test/ckpt")  # an absolute test/ckpt stays itself
    else:
        path = None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"speed=true: no checkpoint for {run.label} at {path or 'test/ckpt (none recorded)'}; "
            "give checkpoint=PATH relative to each run directory (e.g. checkpoints/last.ckpt)"
        )
    return path


def _number(raw: Any) -> float | None:
    """``raw`` as a float, or ``None`` for missing, empty, non-numeric or NaN values."""
    if raw is None or raw == "" or isinstance(raw, bool):
        return None
    try:
        number = float(raw)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number
