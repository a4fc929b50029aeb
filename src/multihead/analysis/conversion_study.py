"""Converting a trained MHA checkpoint to GQA and MLA at set cache ratios, then uptraining
(issue 56; scripts/conversion_study.py).

For each method and ratio ``k`` (the converted sublayers cache ``1/k`` of the bytes per
token they cached before): convert the decoder self- and cross-attention
(:func:`~multihead.checkpoints.conversion.convert_kv_heads`), score, uptrain with
``scripts/train.py init_from=...`` for the largest fraction of the original steps, and
score the step checkpoints at each fraction. MHA itself is the control: uptrained the same
steps with the same recipe. A ratio a method cannot reach is a row marked ``n/a``.

GQA at ratio ``k`` mean-pools ``G/k`` K/V heads. MLA at ratio ``k`` caches ``2 G D / k``
numbers per token in each sublayer: in a rotary one, ``G * rope_dim`` of them are the
rotary key(s) and the rest the latent; in cross-attention, all latent. The MLA methods
(:data:`MLA_METHODS`) add one ingredient at a time (issue 67's ablation): ``mla_svd`` the
weights' SVD with per-group keys (partial RoPE; issue 56's method), ``mla_pca`` the PCA of
the K/V outputs on the run's first ``calibration_batches`` training batches, ``mla_pca_bkv``
K/V balancing, ``mla_pca_bkv_shared`` one rotary key shared by all heads, of the per-group
keys' ``G * rope_dim`` numbers; ``mla_default`` names none of them: each layer's
factorisation, balancing and key layout are chosen by the loss on the held-out quarter of
the calibration batches (:func:`~multihead.checkpoints.conversion.convert_attention`);
``mla_budget`` is the default given the cache, ``1/k`` of each sublayer's, instead of a
rank: how to spend it (the rotary keys' width against the latent's) is measured too, and
``rope_dim`` is not used. ``mla_budget@rope<d>`` is a fixed split of the same budget: keys of
``d`` rotated features per K/V group (or one shared key of ``G * d``, the same cache), the
latent the rest, the other choices measured as the budget's (issue 84: the budget's choice
against the best fixed split).
``distill`` uptrains every row, the MHA control too, with
the KL to the trained checkpoint added to its loss (``distill_from``). The uptraining
schedule does not depend on its length (no cooldown), so the checkpoint at step ``n`` of
the longest run is what an ``n``-step run would give: one run per row serves every fraction.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from multihead.analysis.significance import holm, pooled_paired_bootstrap, t_test_p
from multihead.attention.checks import check_bool
from multihead.checkpoints.conversion import (
    ROTARY_DEFAULTS,
    SCOPES,
    budget_numbers,
    convert_kv_heads,
    recorded_overrides,
)
from multihead.checkpoints.io import load_trained_model, read_checkpoint, write_atomically
from multihead.evaluation import evaluate_checkpoint

# The MLA conversions: convert_attention's options (convert_lm.py's rows too): the fixed
# choices of the ablation, one ingredient added at a time, and mla_default, which names none,
# so each layer's are measured on the calibration batches. "shared" keys get the per-group
# keys' G * rope_dim. mla_budget names none either, and its target is the cache itself.
MLA_METHODS = {
    "mla_svd": {"factorisation": "svd", "balance_kv": False, "rotary_key": "per_group"},
    "mla_pca": {"factorisation": "pca", "balance_kv": False, "rotary_key": "per_group"},
    "mla_pca_bkv": {"factorisation": "pca", "balance_kv": True, "rotary_key": "per_group"},
    "mla_pca_bkv_shared": {"factorisation": "pca", "balance_kv": True, "rotary_key": "shared"},
    "mla_default": {},
    "mla_budget": {},
}
BUDGET_METHOD = "mla_budget"  # a cache budget (1/k), not a latent's width, to convert to
METHODS = ("gqa", *MLA_METHODS)
FIXED_SPLIT = f"{BUDGET_METHOD}@rope"  # + d: the budget with rope_dim=d named (a fixed split)
FIELDS = (
    "method", "ratio", "distill", "target", "kv_bytes_per_token",
    "cross_kv_bytes_per_source_token", "uptrain_fraction", "uptrain_steps", "bleu_lc_tok",
    "bleu", "checkpoint", "convert_cpu_seconds",
)  # fmt: skip


def split_method(method: str) -> tuple[str, int | None]:
    """``method``'s conversion and the rotary key width it names: ``mla_budget@rope4`` is
    ``("mla_budget", 4)``, the budget with ``rope_dim=4`` named; any other method names none.
    A width that is not an even number >= 2 is refused by name."""
    if not method.startswith(FIXED_SPLIT):
        return method, None
    width = method[len(FIXED_SPLIT) :]
    if not width.isdigit() or int(width) < 2 or int(width) % 2:
        raise ValueError(
            f"{method!r}: expected {FIXED_SPLIT}<d>, d an even number >= 2 of rotated features "
            "per K/V group (whole pairs), e.g. mla_budget@rope4"
        )
    return BUDGET_METHOD, int(width)


def row_dirname(method: str, ratio: int) -> str:
    """A row's directory in a study: ``mla_default8``; a fixed split's ``mla_budget@rope4-1of8``
    (its width and ratio apart)."""
    return f"{method}{ratio}" if split_method(method)[1] is None else f"{method}-1of{ratio}"


def check_study(methods: Sequence[str], ratios: Sequence[int], fractions: Sequence[float]) -> None:
    """Refuse bad study settings in one line each, before any work."""
    unknown = [m for m in methods if split_method(m)[0] not in METHODS]
    if unknown or not methods:
        raise ValueError(
            f"methods={list(methods)}; expected a list of {', '.join(METHODS)} or "
            f"{FIXED_SPLIT}<d> (a fixed split of the budget)"
        )
    for k in ratios:
        if isinstance(k, bool) or not isinstance(k, int) or k < 2:
            raise ValueError(f"ratios: {k!r} is not an integer >= 2 (cache 1/k of MHA's)")
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        raise ValueError(f"fractions={list(fractions)}; expected numbers in (0, 1]")


def uptrain_steps(original_steps: int, fractions: Sequence[float]) -> dict[float, int]:
    """Steps per fraction: multiples of the smallest fraction's rounded steps, so that one
    checkpoint interval (that step count) lands on every fraction."""
    unit = max(1, round(min(fractions) * original_steps))
    return {f: unit * max(1, round(f / min(fractions))) for f in sorted(fractions)}


def cache_bytes(ckpt: str | Path) -> tuple[int, int]:
    """Bytes per token the decoder self-attention caches (all layers) and per source token
    the cross-attention caches, counted by the layers' own ``kv_cache_bytes_per_token``."""
    model = load_trained_model(str(ckpt)).model
    total = dict.fromkeys(SCOPES["decoder"], 0)
    for kind, _, _, attn in model.attention_sublayers():
        if kind in total:
            total[kind] += attn.kv_cache_bytes_per_token()
    return total["decoder_self_attention"], total["cross_attention"]


def conversion_target(ckpt: str | Path, method: str, ratio: int, rope_dim: int) -> dict | None:
    """The :func:`convert_kv_heads` keywords that cut each decoder sublayer's cache to
    ``1/ratio``, or ``None`` when ``method`` cannot reach it; an MLA method's latent and
    rotary options (``rope_dim`` per K/V group; a shared key of all ``G * rope_dim``) are
    added by the caller."""
    model = load_trained_model(str(ckpt)).model
    layers = {kind: attn for kind, _, _, attn in model.attention_sublayers()}
    method, width = split_method(method)
    if method == BUDGET_METHOD:  # each sublayer's 1/ratio, its split measured (or named)
        options = ROTARY_DEFAULTS | {"rope_dim": width}
        try:
            for kind in SCOPES["decoder"]:
                budget_numbers(layers[kind], 1 / ratio, options=options)
        except ValueError:  # too small for any split (or for the named one)
            return None
        return {"cache_budget": 1 / ratio}
    if method == "gqa":
        G = {layers[kind].num_kv_heads for kind in SCOPES["decoder"]}
        if len(G) != 1 or next(iter(G)) % ratio:
            return None
        return {"num_kv_heads": next(iter(G)) // ratio}
    latent = {}
    for kind in SCOPES["decoder"]:
        attn = layers[kind]
        width = 2 * attn.num_kv_heads * attn.head_dim // ratio  # numbers cached per token
        rope = attn.num_kv_heads * rope_dim if attn.positions is not None else 0
        if width - rope < 1 or width * ratio != 2 * attn.num_kv_heads * attn.head_dim:
            return None
        latent[kind] = width - rope
    return {"kv_latent_dim": latent, "rope_dim": rope_dim}


def _override_key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def _train(overrides: list[str], recipe: Sequence[str], run_dir: Path, log: Path) -> None:
    """``scripts/train.py`` with ``overrides``, the recipe's keys replacing theirs."""
    ours = {_override_key(o) for o in recipe}
    args = [o for o in overrides if _override_key(o) not in ours] + list(recipe)
    script = Path(__file__).resolve().parents[3] / "scripts" / "train.py"
    command = [sys.executable, str(script), *args, f"hydra.run.dir={run_dir}"]
    log.parent.mkdir(parents=True, exist_ok=True)
    (log.parent / "uptrain_command.json").write_text(json.dumps(command, indent=1))
    with log.open("w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"uptraining failed (exit {done.returncode}); see {log}")


def run_study(
    ckpt: str | Path,
    out: str | Path,
    *,
    methods: Sequence[str] = METHODS,
    ratios: Sequence[int] = (2, 4, 8),
    rope_dim: int = 4,
    selection: str = "high",
    fractions: Sequence[float] = (0.01, 0.02, 0.05),
    recipe: Sequence[str] = (),
    calibration_batches: int = 8,
    distill: bool = False,
    beam_size: int = 5,
    local_dir: str | None = None,
    limit: int | None = None,
) -> list[dict[str, Any]]:
    """Run the study into ``out`` and return its rows.

    Writes ``study.json`` (the settings), ``rows.jsonl`` (one record per measured point, as
    it is measured), ``rows.csv`` and ``bleu_vs_uptraining.png`` at the end, and each row's
    checkpoints, scores and uptraining log under ``out/<method><ratio>/``. A study that
    stopped (a kill, the end of a session) goes on when run again with the same settings
    into the same ``out``: its complete rows are kept, a row it was measuring is measured
    again from its conversion. Other settings into an existing ``out`` are refused.

    Args:
        ckpt: the trained MHA checkpoint; ``ckpt["global_step"]`` is the original steps.
        methods: ``gqa`` and :data:`MLA_METHODS`; MHA, the control, always runs.
        rope_dim, selection: the per-group rotary keys' features and pairs (a shared key
            has ``G * rope_dim``, the same cache).
        recipe: ``scripts/train.py`` overrides of the uptraining, applied to every row
            over the original run's own (e.g. the learning rate and schedule).
        calibration_batches: the run's first training batches the ``mla_pca*`` methods
            calibrate on.
        distill: uptrain every row with ``distill_from=ckpt`` (the KL to the trained model).
        local_dir, limit: the data directory and the number of test sentences to score.
    """
    check_study(methods, ratios, fractions)
    check_bool("distill", distill)
    out = Path(out)
    settings = {
        "ckpt": str(ckpt), "methods": list(methods), "ratios": list(ratios),
        "rope_dim": rope_dim, "selection": selection, "fractions": list(fractions),
        "recipe": list(recipe), "calibration_batches": calibration_batches, "distill": distill,
        "beam_size": beam_size, "local_dir": local_dir, "limit": limit,
    }  # fmt: skip
    done = _resumed(out, settings)
    original_steps = int(read_checkpoint(ckpt)["global_step"])
    steps = uptrain_steps(original_steps, fractions)
    unit, longest = min(steps.values()), max(steps.values())
    schedule = [
        f"trainer.max_steps={longest}", "trainer.max_time=null",
        f"callbacks.checkpoint_recent.every_n_train_steps={unit}",
        "callbacks.checkpoint_recent.save_top_k=-1", "test=false",
    ]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.json").write_text(json.dumps(settings, indent=1) + "\n")
    plan = [("mha", 1, {})]
    for ratio in sorted(ratios, reverse=True):  # the smallest cache first
        for method in methods:
            plan.append((method, ratio, conversion_target(ckpt, method, ratio, rope_dim)))
    rows: list[dict[str, Any]] = []
    points = 1 + len(steps)  # a complete row: scored converted and at each fraction

    def record(**row: Any) -> None:
        rows.append({field: row.get(field) for field in FIELDS})
        with (out / "rows.jsonl").open("a") as f:
            f.write(json.dumps(rows[-1]) + "\n")

    def score(path: Path, where: Path) -> dict[str, Any]:
        return evaluate_checkpoint(
            str(path), where, beam_size=beam_size, local_dir=local_dir, limit=limit
        )

    # The rows a stopped study completed stay; what it left of the row it was measuring goes.
    measured = Counter(_row_key(r) for r in done)
    kept = [r for r in done if measured[_row_key(r)] == points or r["target"] == "n/a"]
    _write_rows(out, kept)
    rows.extend(kept)
    for method, ratio, target in plan:
        row_dir = out / row_dirname(method, ratio)
        if any(_row_key(r) == (method, ratio) for r in kept):
            continue
        if row_dir.exists():
            shutil.rmtree(row_dir)
        if target is None:
            record(method=method, ratio=ratio, distill=distill, target="n/a")
            continue
        convert_seconds = None
        if method == "mha":
            start, overrides = Path(ckpt), [*recorded_overrides(ckpt), f"init_from={ckpt}"]
        else:
            began = time.process_time()
            written, overrides = convert_kv_heads(
                ckpt, target.get("num_kv_heads"), row_dir / "converted.ckpt",
                kv_latent_dim=target.get("kv_latent_dim"), cache_budget=target.get("cache_budget"),
                **mla_options(ckpt, method, rope_dim, selection, calibration_batches, local_dir),
            )  # fmt: skip
            start, convert_seconds = written, round(time.process_time() - began, 2)
        if distill:  # the teacher: the trained checkpoint, for the MHA control too
            overrides = [*overrides, f"distill_from={ckpt}"]
        self_bytes, cross_bytes = cache_bytes(start)
        common = dict(
            method=method, ratio=ratio, distill=distill, target=json.dumps(target or "mha"),
            kv_bytes_per_token=self_bytes, cross_kv_bytes_per_source_token=cross_bytes,
            convert_cpu_seconds=convert_seconds,
        )  # fmt: skip
        run_dir = row_dir / "uptrain"
        points = [(0.0, 0, Path(start))] + [
            (fraction, n, run_dir / "checkpoints" / f"step{n}.ckpt")
            for fraction, n in steps.items()
        ]
        for fraction, n, path in points:
            if n and not run_dir.exists():  # the first uptrained point: train them all
                _train(overrides, [*recipe, *schedule], run_dir, row_dir / "uptrain.log")
            scores = score(path, row_dir / f"score_step{n}")
            record(
                **common, uptrain_fraction=fraction, uptrain_steps=n, checkpoint=str(path),
                bleu_lc_tok=scores["bleu_lc_tok"], bleu=scores["bleu"],
            )  # fmt: skip
    write_table(rows, out / "rows.csv")
    plot_study(rows, out / "bleu_vs_uptraining.png")
    return rows


def _row_key(row: dict[str, Any]) -> tuple[str, int]:
    return row["method"], row["ratio"]


def _write_rows(out: Path, rows: list[dict[str, Any]]) -> None:
    text = "".join(json.dumps(row) + "\n" for row in rows)
    write_atomically(out / "rows.jsonl", lambda f: f.write(text.encode()))


def _resumed(out: Path, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The points a stopped study in ``out`` measured with these ``settings`` (none for a
    new ``out``); another study's ``out`` is refused."""
    if not out.exists():
        return []
    path = out / "study.json"
    try:
        before = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        raise FileExistsError(
            f"{out} exists and holds no study's settings ({path.name}); choose a new out= directory"
        ) from None
    changed = [f"{k}={before.get(k)!r} there, {v!r} now" for k, v in settings.items()
               if before.get(k) != v]  # fmt: skip
    if changed:
        raise FileExistsError(
            f"{out} holds a study with other settings ({'; '.join(changed)}); run it again "
            "with its own to go on, or choose a new out= directory"
        )
    rows = out / "rows.jsonl"
    return [json.loads(line) for line in rows.read_text().splitlines()] if rows.exists() else []


def mla_options(
    ckpt: str | Path, method: str, rope_dim: int, selection: str, calibration_batches: int,
    local_dir: str | None,
) -> dict[str, Any]:  # fmt: skip
    """:func:`convert_kv_heads`'s latent options for ``method`` (none for ``gqa``)."""
    method, width = split_method(method)
    if method not in MLA_METHODS:
        return {}
    options = dict(MLA_METHODS[method])
    if options.get("factorisation") != "svd":  # the PCA, or the default's measurement
        options |= {"calibration_batches": calibration_batches, "local_dir": local_dir}
    if method == BUDGET_METHOD:  # the keys' width measured, or a fixed split's named
        return options if width is None else options | {"rope_dim": width}
    if options.get("rotary_key") == "shared":  # the per-group keys' numbers, in one key
        model = load_trained_model(str(ckpt)).model
        groups = {a.num_kv_heads for k, _, _, a in model.attention_sublayers()
                  if k == "decoder_self_attention"}  # fmt: skip
        return options | {"rope_dim": groups.pop() * rope_dim}
    return options | {"rope_dim": rope_dim, "selection": selection}


def write_table(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def plot_study(rows: list[dict[str, Any]], path: Path) -> None:
    """lc-tok BLEU against the uptraining fraction, one line per method and cache ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    lines: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for row in rows:
        if row["bleu_lc_tok"] is not None:
            lines.setdefault((row["method"], row["ratio"]), []).append(
                (100 * row["uptrain_fraction"], row["bleu_lc_tok"])
            )
    methods = dict.fromkeys(("mha", *METHODS, *(method for method, _ in lines)))
    colours = {method: f"C{i % 10}" for i, method in enumerate(methods)}
    styles = {8: "-", 4: "--", 2: "-."}  # the cache ratio; others dotted
    for (method, ratio), points in lines.items():
        label = "MHA (control)" if method == "mha" else f"{method} 1/{ratio} cache"
        style = ":" if method == "mha" else styles.get(ratio, ":")
        ax.plot(*zip(*sorted(points), strict=True), style, color=colours[method], marker="o",
                label=label)  # fmt: skip
    ax.set_xlabel("uptraining steps, % of the original training's")
    ax.set_ylabel("test2016 BLEU (lc-tok)")
    if any(row["distill"] for row in rows):
        ax.set_title("uptrained with distillation from the trained model", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def paired_block_tests(studies: Sequence[dict], baseline: str = "mla_default") -> list[dict]:
    """The LM study's paired tests (``scripts/convert_lm.py``'s ``results.json``, one per
    uptraining seed): at each ratio, every other MLA method's row against ``baseline``'s, right
    after conversion (step ``0``) and after uptraining (the last step).

    The unit is the held-out block: each block's loss difference (method minus baseline),
    averaged over the studies (seeds), tested for mean 0 with the one-sample t-test; Holm over
    every test returned (a row that is the baseline's model, every block's loss the same in
    every seed, is marked ``same`` and not tested). Right after conversion the seeds give
    the same losses (the seed orders only the uptraining's batches); after uptraining,
    ``seed_deltas`` shows whether the seeds agree, the noise a block test cannot see.
    ``delta_pct`` is the perplexity's change, ``100 * (exp(mean difference) - 1)``: positive
    when the method is worse.
    """
    if not studies:
        raise ValueError("no studies given; expected results.json of convert_lm.py")
    rows = []
    for i, study in enumerate(studies):
        named = {row["name"]: row for row in study["rows"]}
        missing = [name for name, row in named.items() if "block_loss" not in row]
        if missing:
            raise ValueError(
                f"study {i}: rows {missing} hold no block_loss; expected convert_lm.py's "
                "rows since the per-block losses (run them again into a new OUT_DIR)"
            )
        rows.append(named)
    names = set.intersection(*(set(named) for named in rows))
    tests = []
    for name in sorted(names):
        method, _, ratio = name.partition(" ")
        base = f"{baseline} {ratio}"
        if method in (baseline, "MHA", "gqa") or base not in names:
            continue
        for step in sorted(rows[0][name]["block_loss"], key=int):
            per_seed = []
            for named in rows:
                a, b = named[name]["block_loss"][step], named[base]["block_loss"][step]
                per_seed.append([x - y for x, y in zip(a, b, strict=True)])
            blocks = [statistics.fmean(d) for d in zip(*per_seed, strict=True)]
            if not any(any(d) for d in per_seed):  # the same model: nothing to test
                tests.append({"ratio": ratio, "method": method, "step": int(step),
                              "blocks": len(blocks), "same": True})  # fmt: skip
                continue
            tests.append({
                "ratio": ratio, "method": method, "step": int(step), "blocks": len(blocks),
                "delta_pct": 100 * math.expm1(statistics.fmean(blocks)),
                "seed_deltas": [100 * math.expm1(statistics.fmean(d)) for d in per_seed],
                "p": t_test_p(blocks),
            })  # fmt: skip
    return _holm_over_the_tested(tests)


def _holm_over_the_tested(tests: list[dict]) -> list[dict]:
    """Holm over the tests that compare two different models; a row that is the same model
    as the baseline (``same``: every unit's difference 0 in every seed, as when the measured
    choice is that fixed row) is no test, so it neither counts in the family nor gets a p.
    (sacreBLEU's paired bootstrap gives a system against itself p = 1 / (samples + 1).)"""
    tested = [t for t in tests if not t.get("same")]
    for test, adjusted in zip(tested, holm([t["p"] for t in tested]), strict=True):
        test["p_holm"] = adjusted
    for test in tests:
        test.setdefault("same", False)
    return tests


def hypotheses_path(study: Path, row: dict[str, Any]) -> Path:
    """Where :func:`run_study` wrote a row's test hypotheses."""
    where = study / row_dirname(row["method"], row["ratio"]) / f"score_step{row['uptrain_steps']}"
    return where / "hypotheses.test.txt"


def paired_sentence_tests(
    studies: Sequence[str | Path],
    references: Sequence[str],
    lang: str,
    baseline: str = "mla_default",
    metric: str = "lc-tok",
) -> list[dict]:
    """The translation study's paired tests (:func:`run_study` directories, one per
    uptraining seed): at each ratio, every other MLA method's row against ``baseline``'s,
    right after conversion (step 0) and after the longest uptraining.

    The unit is the test sentence: sacreBLEU's paired bootstrap with the BLEU difference
    averaged over the studies, each resample drawing the same sentences in every study
    (:func:`~multihead.analysis.significance.pooled_paired_bootstrap`); Holm over every test
    returned (a row whose translations are the baseline's in every seed is marked ``same``
    and not tested). As in :func:`paired_block_tests`, the seeds' own spread is not in the test:
    ``seed_deltas`` shows whether they agree.
    """
    if not studies:
        raise ValueError("no studies given; expected conversion_study.py out= directories")
    rows = []
    for study in map(Path, studies):
        path = study / "rows.jsonl"
        if not path.is_file():
            raise ValueError(f"{study} holds no rows.jsonl; expected a conversion_study.py out=")
        named = {}
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row["bleu_lc_tok"] is not None:  # a row the ratio cannot reach has none
                named[(row["method"], row["ratio"], row["uptrain_steps"])] = (study, row)
        rows.append(named)
    keys = set.intersection(*(set(named) for named in rows))
    last = max((steps for _, _, steps in keys), default=0)
    tests = []
    for method, ratio, steps in sorted(keys, key=lambda k: (-k[1], k[0], k[2])):
        base = (baseline, ratio, steps)
        if method in (baseline, "mha", "gqa") or base not in keys or steps not in (0, last):
            continue
        hyps = {}
        for side, key in (("base", base), ("method", (method, ratio, steps))):
            hyps[side] = []
            for named in rows:
                path = hypotheses_path(*named[key])
                if not path.is_file():
                    raise ValueError(f"{path} is missing; expected run_study's hypotheses")
                hyps[side].append(path.read_text().splitlines())
        if hyps["base"] == hyps["method"]:  # the same translations in every seed
            tests.append({"ratio": ratio, "method": method, "step": steps,
                          "sentences": len(references), "same": True})  # fmt: skip
            continue
        result = pooled_paired_bootstrap(
            hyps["base"], hyps["method"], references, metric=metric, lang=lang
        )
        tests.append({
            "ratio": ratio, "method": method, "step": steps, "sentences": len(references),
            "delta": result.delta, "seed_deltas": list(result.seed_deltas),
            "low": result.low, "high": result.high, "p": result.p_value,
        })  # fmt: skip
    return _holm_over_the_tested(tests)
