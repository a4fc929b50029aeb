"""The comparison's second stage, runs grouped: which task they are, which runs are seeds
of one design (pooled), which are points of its learning-rate grid, and which are refused.

A design is a run name (what the model built tags itself, ``lm-mla8r24rope8_sdpa``), split
further by the config keys the user names in ``split_by``: a control that differs from its
design in a key the tag does not tell, say ``model.ffn_dim``, is ``name {model.ffn_dim=608}``
(the value most runs of the name hold is the design's own, which keeps the plain name).
Runs of one design at several learning rates (``module.optimizer.lr``) are a grid: each rate
is scored by the mean of a figure on a split that is not the scored held-out data (the
``grid`` option, by task), the best is the design's chosen rate, and only the runs at that
rate go on to the tests. The runs at one rate are seeds of one configuration: pooled only
if their configs differ in nothing but a seed and where they write, and they ran on one
thread count and one CPU model, unless the user names the key (or ``threads``, ``cpu``) in
``pool_despite``. A run without a saved config cannot be checked, and is refused by name.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from multihead.analysis.runs import HYP_BLEU, RunResult, number

LR_KEY = "module.optimizer.lr"
# What the grid chooses by, per task: a figure on data the tests do not score, and whether
# lower is better. The LM's and MQAR's held-out figures (val/) are the scored ones, so their
# rates are chosen on a selection split (select/) of their own.
GRID_METRICS = {"translation": "val/bleu", "lm": "select/loss", "mqar": "select/loss"}
HOST_KEYS = {"threads": "run/threads", "cpu": "run/cpu"}  # pooled only where they agree


def task(run: RunResult) -> str:
    """``lm`` (loss by position), ``mqar`` (accuracy by setting) or ``translation``."""
    if any(k.startswith("val/acc@") for k in run.summary):
        return "mqar"
    return "lm" if any(k.startswith("val/loss@") for k in run.summary) else "translation"


def lower_is_better(key: str) -> bool:
    return "loss" in key or "ppl" in key


def flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``config``'s leaves by dotted key (``attention.design_options.cap``)."""
    found = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            found |= flat(value, f"{prefix}{key}.")
        else:
            found[f"{prefix}{key}"] = value
    return found


def learning_rate(run: RunResult) -> float | None:
    return number(flat(run.config or {}).get(LR_KEY))


def check_saved_configs(runs: list[RunResult]) -> None:
    """Refuse, by its directory, a run without a saved config: nothing says what it is, so
    nothing can say whether it may be pooled (``hydra.output_subdir=null`` saves none)."""
    for run in runs:
        if run.config is None:
            raise ValueError(
                f"{run.source}: no saved config (.hydra/config.yaml), so it cannot be checked "
                "against the runs it would be pooled with (trained with "
                "hydra.output_subdir=null?); compare runs that kept their config"
            )


# ---------------------------------------------------------------------------------------
# Seeds: runs of one design and rate


def design_of(run: RunResult) -> str:
    """The design ``run`` belongs to: its grouping's name, else its run name, else its label."""
    return run.design or str(run.get("run_name") or run.label)


def has_repeats(runs: list[RunResult]) -> bool:
    """Whether some design was run more than once, e.g. with two seeds."""
    names = [design_of(run) for run in runs]
    return len(set(names)) < len(names)


# Config keys in which the seeds of one configuration may differ: a seed at any level, and
# where a run reads and writes (any *dir or *dirpath, the loggers, its wandb group, a resume,
# the task_name its output directory is named by; wandb keeps the config resolved, so these
# name each run's own directory there).
NOT_THE_CONFIGURATION = ("ckpt_path", "wandb_group", "task_name")
NOT_THE_CONFIGURATION_PREFIXES = ("logger.",)


def _not_the_configuration(key: str) -> bool:
    leaf = key.rsplit(".", 1)[-1]
    return (
        leaf == "seed"
        or leaf.endswith(("dir", "dirpath"))
        or key in NOT_THE_CONFIGURATION
        or key.startswith(NOT_THE_CONFIGURATION_PREFIXES)
    )


def config_differences(
    a: RunResult, b: RunResult, also: Sequence[str] = ()
) -> list[tuple[str, Any, Any]]:
    """``(key, a's value, b's value)`` for every config key in which the two runs differ,
    beyond a seed, where they write (:data:`NOT_THE_CONFIGURATION`) and the keys ``also``."""
    mine, other = flat(a.config or {}), flat(b.config or {})
    return [
        (key, mine.get(key), other.get(key))
        for key in sorted(mine.keys() | other.keys())
        if not _not_the_configuration(key) and key not in also and mine.get(key) != other.get(key)
    ]


def check_seed_configs(runs: list[RunResult], pool_despite: Sequence[str] = ()) -> list[str]:
    """Refuse to pool runs of one design and learning rate (seeds of one configuration)
    whose configs differ in anything but a seed and where they read and write
    (:data:`NOT_THE_CONFIGURATION`), or that ran on other thread counts or CPU models
    (``run/threads``, ``run/cpu`` in their summaries), naming the first difference.

    Keys in ``pool_despite`` may differ too (``threads`` and ``cpu`` for the machine): the
    user's word that they do not change the run, say a key a later commit added whose
    default is the old behaviour. The keys that did differ are returned, for the report to
    name."""
    despite = set()
    for name, group in seed_groups(runs).items():
        for rate in dict.fromkeys(learning_rate(run) for run in group):
            pool = [run for run in group if learning_rate(run) == rate]
            despite |= _check_pool(name, pool, pool_despite)
    return sorted(despite)


def _check_pool(name: str, pool: list[RunResult], pool_despite: Sequence[str]) -> set[str]:
    despite = set()
    first = pool[0]
    for run in pool[1:]:
        for what, key in HOST_KEYS.items():
            mine, theirs = first.get(key), run.get(key)
            if mine == theirs:
                continue
            if what in pool_despite:
                despite.add(what)
                continue
            raise ValueError(
                f"runs {first.source} and {run.source} are pooled as seeds of {name!r} but "
                f"ran on {what} {mine!r} and {theirs!r} ({key}): a pool's runs share the "
                f"machine's settings; compare runs of one {what}, or name {what} in "
                "pool_despite to pool them anyway"
            )
        for key, mine, theirs in config_differences(first, run):
            if key in pool_despite:
                despite.add(key)
                continue
            raise ValueError(
                f"runs {first.source} and {run.source} share the run name {name!r} but "
                f"their configs differ in {key} ({mine!r} against "
                f"{theirs!r}): runs of one name are pooled as seeds of one "
                "configuration; compare runs that differ in their seed alone, or name "
                "the key in pool_despite if it does not change the run (split_by if it "
                "makes another design)"
            )
    return despite


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
        f"\n\nSeeds of one design are pooled although their configs differ in "
        f"{', '.join(keys)} (pool_despite: the user's word that these do not change the run; "
        "threads and cpu are the machine's thread count and CPU model)."
    )


def seed_groups(runs: list[RunResult]) -> dict[str, list[RunResult]]:
    """The runs by design (:func:`design_of`), in the order of ``runs``."""
    groups: dict[str, list[RunResult]] = {}
    for run in runs:
        groups.setdefault(design_of(run), []).append(run)
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


# ---------------------------------------------------------------------------------------
# The learning-rate grid


@dataclass
class Grid:
    """One design's runs by learning rate, each rate scored by ``metric`` (the mean over
    its runs at the grid's seeds), and the rate chosen."""

    design: str
    metric: str
    runs: dict[float | None, list[RunResult]]
    scores: dict[float | None, float | None] = field(default_factory=dict)
    chosen: float | None = None
    seeds: tuple = ()  # the seeds every rate ran: the only ones that score a rate

    @property
    def edge(self) -> bool:
        """Whether the chosen rate is the grid's smallest or largest (of two or more)."""
        rates = sorted(r for r in self.runs if r is not None)
        return len(rates) > 1 and self.chosen in (rates[0], rates[-1])

    def scored(self, rate: float | None) -> list[RunResult]:
        """The runs of ``rate`` that score it: those at the grid's seeds."""
        return [run for run in self.runs[rate] if run.seed in self.seeds]


def make_grid(design: str, runs: list[RunResult], metric: str) -> Grid:
    """``runs`` of one design by learning rate; the chosen rate has the best mean ``metric``
    over the seeds every rate ran. Seeds run only at the chosen rate, after the choice, do not
    vote: a rate's mean over three seeds against another's one seed would compare seeds, not
    rates. With one rate it is chosen; with several, rates that share no seed, or a rate whose
    runs lack ``metric``, are refused."""
    by_rate: dict[float | None, list[RunResult]] = {}
    for run in runs:
        by_rate.setdefault(learning_rate(run), []).append(run)
    grid = Grid(design, metric, dict(sorted(by_rate.items(), key=lambda kv: kv[0] or 0.0)))
    seeds = [{run.seed for run in pool} for pool in grid.runs.values()]
    grid.seeds = tuple(sorted(set.intersection(*seeds), key=str))
    if len(grid.runs) == 1:
        grid.chosen = next(iter(grid.runs))
        grid.scores[grid.chosen] = _mean(grid.scored(grid.chosen), metric)
        return grid
    if not grid.seeds:
        found = "; ".join(f"{'no lr' if rate is None else format(rate, 'g')}: "
                          f"{sorted(s, key=str)}" for rate, s in
                          zip(grid.runs, seeds, strict=True))  # fmt: skip
        raise ValueError(
            f"{design}: the learning rates of its grid share no seed ({found}); expected "
            "every rate run at one seed at least, so that the rates are compared at the same "
            "seeds"
        )
    for rate in grid.runs:
        lacking = [run for run in grid.scored(rate) if number(run.get(metric)) is None]
        if lacking:
            raise ValueError(
                f"{design}: runs at learning rates {sorted(grid.runs, key=lambda r: r or 0.0)} "
                f"make a grid, but those at {rate} have no {metric} to choose by "
                f"({lacking[0].source}); expected the grid's figure in every run's summary "
                "(set grid.<task>=KEY)"
            )
        grid.scores[rate] = _mean(grid.scored(rate), metric)
    sign = 1.0 if lower_is_better(metric) else -1.0
    grid.chosen = min(grid.scores, key=lambda r: sign * grid.scores[r])
    return grid


def _mean(runs: list[RunResult], metric: str) -> float | None:
    values = [v for run in runs if (v := number(run.get(metric))) is not None]
    return statistics.fmean(values) if values else None


# ---------------------------------------------------------------------------------------
# The stage


@dataclass
class Grouped:
    """The runs grouped: those the tests read (each design at its chosen rate), the grids,
    the keys pooled despite a difference, and the task."""

    runs: list[RunResult]
    grids: dict[str, Grid]
    despite: list[str]
    task: str


def name_designs(runs: list[RunResult], split_by: Sequence[str]) -> None:
    """Set each run's ``design``: its run name, and ``{key=value, ...}`` of the ``split_by``
    keys in which it differs from the runs of its name (a control: what most of the name's
    runs hold is the design's own, and keeps the plain name; without a majority every run
    shows its values)."""
    by_name: dict[str, list[RunResult]] = {}
    for run in runs:
        by_name.setdefault(str(run.get("run_name") or run.label), []).append(run)
    for name, group in by_name.items():
        configs = [flat(run.config or {}) for run in group]
        values = [tuple(repr(c.get(k)) for k in split_by) for c in configs]
        counts = sorted((values.count(v) for v in set(values)), reverse=True)
        tied = len(counts) > 1 and counts[0] == counts[1]  # no value is the design's own
        own = None if tied else max(values, key=values.count)
        for run, config, mine in zip(group, configs, values, strict=True):
            if own is None:
                differ = [k for i, k in enumerate(split_by) if len({v[i] for v in values}) > 1]
            else:
                differ = [k for k, a, b in zip(split_by, mine, own, strict=True) if a != b]
            variant = ", ".join(f"{k}={config.get(k)}" for k in differ)
            run.design = f"{name} {{{variant}}}" if variant else name


def group_runs(
    runs: list[RunResult],
    *,
    pool_despite: Sequence[str] = (),
    split_by: Sequence[str] = (),
    grid: Mapping[str, str] | None = None,
) -> Grouped:
    """The grouping stage: every run's config kept (else refused by name), one task, the
    designs named, their grids, the pools checked. ``grid``: the figure each task's grid
    chooses by (:data:`GRID_METRICS` where not given)."""
    for name, keys in (("pool_despite", pool_despite), ("split_by", split_by)):
        if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
            raise ValueError(
                f"{name}={keys!r}: expected a list of config keys, e.g. "
                f"{name}=[module.scheduler.decay]"
            )
    if grid is not None and (
        not isinstance(grid, Mapping)
        or not set(grid) <= set(GRID_METRICS)
        or not all(isinstance(k, str) for k in grid.values())
    ):
        raise ValueError(
            f"grid={grid!r}: expected the figure each task's learning-rate grid chooses by, "
            f"e.g. grid.lm=select/loss (tasks: {', '.join(GRID_METRICS)})"
        )
    tasks = {task(run) for run in runs}
    if len(tasks) > 1 and "translation" in tasks:
        long = [run for run in runs if task(run) != "translation"]
        raise ValueError(
            f"{len(long)} of the {len(runs)} runs are decoder-only LM or MQAR runs: "
            "compare them apart from translation runs"
        )
    check_saved_configs(runs)
    for kind in tasks:  # the LM and MQAR runs of one design share a run name, not a config
        name_designs([r for r in runs if task(r) == kind], split_by)
    metrics = {**GRID_METRICS, **(grid or {})}
    grids, chosen = {}, []
    for kind in sorted(tasks):  # the LM and MQAR runs of one design share its run name
        for name, pool in seed_groups([r for r in runs if task(r) == kind]).items():
            found = make_grid(name, pool, metrics.get(kind, GRID_METRICS["translation"]))
            grids[name if len(tasks) == 1 else f"{kind}: {name}"] = found
            chosen += found.runs[found.chosen]
    despite = set()
    for kind in sorted(tasks):
        despite |= set(check_seed_configs([r for r in runs if task(r) == kind], pool_despite))
    refuse_unused_pool_despite(pool_despite, sorted(despite))
    chosen_ids = {id(run) for run in chosen}
    kept = [run for run in runs if id(run) in chosen_ids]
    return Grouped(kept, grids, sorted(despite), "translation" if tasks == {"translation"}
                   else "long context")  # fmt: skip


# ---------------------------------------------------------------------------------------
# Runs at a longer budget: does each order hold there?

BUDGET_KEY = "trainer.max_steps"


def longer_budget(
    compared: list[RunResult], longer: list[RunResult], split_by: Sequence[str] = ()
) -> dict[tuple[str, str], dict[Any, RunResult]]:
    """``longer``, runs of the compared designs trained longer, as ``{(task, design): {seed:
    run}}``. Each is checked against the compared runs of its design (``compared``, each
    design at its chosen rate): the same config but for a larger ``trainer.max_steps``, its
    seed and where it writes, all at one budget. A run of a design not compared, or whose
    config differs in anything else (its learning rate, its data), is refused by name: its
    order would not say whether the compared order holds."""
    check_saved_configs(longer)
    for kind in {task(run) for run in longer}:
        name_designs([run for run in longer if task(run) == kind], split_by)
    ours: dict[tuple[str, str], RunResult] = {}
    compared_seeds: dict[tuple[str, str], set] = {}
    for run in compared:
        ours.setdefault((task(run), design_of(run)), run)
        compared_seeds.setdefault((task(run), design_of(run)), set()).add(run.seed)
    found: dict[tuple[str, str], dict[Any, RunResult]] = {}
    for run in longer:
        key = (task(run), design_of(run))
        if key not in ours:
            raise ValueError(
                f"{run.source}: a longer run of {key[1]!r} ({key[0]}), which the comparison "
                "has no runs of; expected the compared designs, trained longer"
            )
        mine, other = flat(ours[key].config or {}), flat(run.config or {})
        budget, more = number(mine.get(BUDGET_KEY)), number(other.get(BUDGET_KEY))
        if more is None or budget is None or more <= budget:
            raise ValueError(
                f"{run.source}: {BUDGET_KEY}={other.get(BUDGET_KEY)}, where the compared "
                f"runs of {key[1]!r} train {mine.get(BUDGET_KEY)} steps; expected a longer "
                "budget"
            )
        differ = config_differences(ours[key], run, also=[BUDGET_KEY])
        if differ:
            name, ours_value, theirs = differ[0]
            raise ValueError(
                f"{run.source}: a longer run of {key[1]!r} whose config differs from the "
                f"compared runs' in {name} ({ours_value!r} against {theirs!r}), not only in "
                f"{BUDGET_KEY}; expected the same run trained longer (at the design's "
                "chosen rate)"
            )
        if run.seed not in compared_seeds[key]:
            raise ValueError(
                f"{run.source}: a longer run of {key[1]!r} with seed {run.seed}, which its "
                f"compared runs do not have (seeds {sorted(compared_seeds[key], key=str)}); "
                "expected a compared run trained longer, read against its own seed"
            )
        seeds = found.setdefault(key, {})
        if run.seed in seeds:
            raise ValueError(
                f"two longer {key[1]} runs with seed {run.seed}: {seeds[run.seed].source} "
                f"and {run.source}; give one run per design and seed"
            )
        seeds[run.seed] = run
    budgets = sorted({flat(run.config or {}).get(BUDGET_KEY) for run in longer})
    if len(budgets) > 1:
        raise ValueError(
            f"the longer runs train {', '.join(map(str, budgets))} steps; expected one longer "
            "budget (compare each budget apart)"
        )
    return found


# ---------------------------------------------------------------------------------------
# The long-context runs by design and seed

DESIGN_ORDER = {"mha": 0, "gqa": 1, "mqa": 2, "mla": 3}


def _bucket_key(key: str) -> tuple[int, ...]:
    name = key.split("@", 1)[1]
    if "x" in name:  # MQAR: SEQxPAIRS
        seq, pairs = name.split("x")
        return int(seq), int(pairs)
    return tuple(int(p) for p in name.split("-"))


def figures(runs: list[RunResult], prefix: str) -> list[str]:
    """The ``prefix@...`` keys the runs share, in bucket or grid order."""
    keys = set.intersection(*({k for k in r.summary if k.startswith(prefix)} for r in runs))
    return sorted(keys, key=_bucket_key)


def by_design(runs: list[RunResult]) -> dict[str, dict[Any, RunResult]]:
    """``{design: {seed: run}}`` in MHA, GQA, MQA, MLA order; two runs of one design and
    seed are refused."""
    groups: dict[str, dict[Any, RunResult]] = {}
    for run in runs:
        seeds = groups.setdefault(design_of(run), {})
        if run.seed in seeds:
            raise ValueError(
                f"two {design_of(run)} runs with seed {run.seed}: {seeds[run.seed].source} "
                f"and {run.source}; compare one run per design and seed"
            )
        seeds[run.seed] = run
    kind = {d: str(next(iter(s.values())).get("kind")) for d, s in groups.items()}
    return dict(sorted(groups.items(), key=lambda kv: (DESIGN_ORDER.get(kind[kv[0]], 9),
                                                        "{" in kv[0])))  # fmt: skip


def display_names(designs: dict[str, dict[Any, RunResult]]) -> dict[str, str]:
    """Each design shown by its kind where the kind is unique, else ``kind (design)``."""
    kinds = {d: str(next(iter(s.values())).get("kind")) for d, s in designs.items()}
    counts = list(kinds.values())
    return {d: k if counts.count(k) == 1 else f"{k} ({d})" for d, k in kinds.items()}
