"""Issue 56's LM study: a trained Llama-shaped LM converted to GQA and MLA, then uptrained;
with issue 67's ablation of the MLA conversion.

python scripts/convert_lm.py RUN_DIR OUT_DIR [--data DIR] [--fractions 0.01 0.02 0.05] [--lr 3e-4]
    [--methods gqa mla_svd mla_pca mla_pca_bkv mla_pca_bkv_shared] [--distill] [--seed 0]

``RUN_DIR`` is a ``scripts/train.py experiment=lm_multi30k`` run (``hf/``, ``tokenizer.json``,
``summary.json``, ``.hydra/config.yaml``). Every attention module is swapped for the layer
(``replace_hf_attention``), then each layer is converted (``convert_attention``):

* ``gqa``: ``with_kv_heads`` (mean-pooled K/V heads), 4, 2 and 1 K/V heads;
* the MLA methods (``MLA_METHODS`` of ``multihead.analysis.conversion_study``):
  ``mla_default`` (each layer's factorisation, K/V balancing and rotary key layout chosen by
  ``convert_attention`` on the held-out quarter of the calibration batch, by the model's
  loss; its choices and every candidate's loss in the row's ``chosen``), then the fixed
  choices, one ingredient added at a time: ``mla_svd`` (partial RoPE + the weights' joint
  SVD: issue 56's MLA),
  ``mla_pca`` (the latent from the PCA of the K/V outputs on the calibration batch),
  ``mla_pca_bkv`` (+ K/V balancing), ``mla_pca_bkv_shared`` (+ one rotary key shared by all
  heads instead of one per K/V group); ``mla_budget``, the default given each layer's cache,
  1/8, 1/4, 1/2 of MHA's, instead of ``r``: the rotary keys' width against the latent's is
  measured with the other choices (``convert_attention(cache_budget=...)``; no grid below,
  each layer's split in the row's ``chosen``); ``mla_budget@rope<d>``, a fixed split of the
  same budget (keys of ``d`` rotated features per K/V group or one shared key of ``G * d``,
  the latent the rest, the other choices measured: the budget's choice against each fixed
  split, issue 84). A latent of ``r`` beside ``rope_dim`` rotated
  features per K/V group (or a shared key of ``G * rope_dim``), ``r + G * rope_dim`` = 1/2,
  1/4, 1/8 of MHA's cache; of the ``rope_dim`` (and, for per-group keys, pair selections)
  tried, the one with the lowest loss on the calibration batch (16 training blocks, not the
  validation split), per method;
* MHA: the swapped model unchanged, the control.

Each is scored (validation perplexity) right after conversion and while uptrained with one
recipe: AdamW, constant learning rate (no warmup, no decay), the training's batches, for the
largest fraction of the original steps; the smaller fractions are that run's scores at
their step counts (with a constant rate, the first n steps of the run are the n-step run).
``--anneal`` lets the rate fall linearly to zero over the largest fraction's steps instead
(the trained model ends its own schedule annealed; a constant rate undoes some of that).
``--distill`` adds to every row's loss, the MHA control's too, the KL from the trained
(swapped, unconverted) model's next-token distribution to the row's (weight 1). Writes
``OUT_DIR/results.json`` and ``OUT_DIR/uptraining.png``; rows of another recipe (rate,
schedule, steps, distillation) are refused: one recipe per ``OUT_DIR``.
"""

import argparse
import copy
import functools
import json
import math
import time
from pathlib import Path

from multihead.cli import exit_on_user_error, register_resolvers

import lightning.pytorch as pl
import torch
from omegaconf import OmegaConf
from transformers import LlamaForCausalLM

from multihead.analysis.conversion_study import (
    BUDGET_METHOD,
    FIXED_SPLIT,
    MLA_METHODS,
    check_study,
    split_method,
)
from multihead.attention import MultiHeadAttention
from multihead.checkpoints import write_atomically
from multihead.checkpoints.conversion import ROTARY_DEFAULTS, budget_numbers, convert_attention
from multihead.data.lm import LanguageModelDataModule
from multihead.data.tokenizer import Tokenizer
from multihead.integrations.huggingface import replace_hf_attention
from multihead.training.lm import LanguageModelModule, next_token_logits, position_losses

register_resolvers()

RATIOS = (8, 4, 2)  # MHA's cache over the converted one's; the hardest first
ROPE_DIMS = (2, 4, 8)  # per K/V group; a shared key has G times as many
SELECTIONS = ("high", "uniform", "norm")
UPTRAIN_LR = 3e-4
METHODS = ("gqa", *MLA_METHODS)


def cache_bytes(model) -> int:
    """K/V bytes per token (fp32) summed over the layers, from the layers' own count."""
    layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    return sum(attn.kv_cache_bytes_per_token() for attn in layers)


def convert(model, kind: str, value: int | None, calibration: dict, **options):
    """A converted deep copy of the swapped ``model`` (``kind``: mha, gqa or an MLA method;
    ``value``: the K/V heads, the latent's ``r`` or, for the budget, the cache's fraction)
    and :func:`convert_attention`'s per-layer report (``[]`` for mha)."""
    model = copy.deepcopy(model)
    if kind == "mha":
        return model, []
    if kind == "gqa":
        return model, convert_attention(model, kv_heads=value, calibration=calibration)
    kind, width = split_method(kind)
    options = MLA_METHODS[kind] | options | ({"rope_dim": width} if width else {})
    size = {"cache_budget": value} if kind == BUDGET_METHOD else {"kv_latent": value}
    return model, convert_attention(model, **size, calibration=calibration, **options)


def batch_loss(model, batch) -> float:
    with torch.no_grad():
        return model(input_ids=batch, labels=batch, use_cache=False).loss.item()


def block_losses(model, blocks: torch.Tensor, batch_size: int) -> list[float]:
    """Each held-out block's mean next-token loss (nats), the unit the paired tests pair on
    (``scripts/conversion_tests.py``); the blocks are equally long, so their mean is
    ``val/loss``."""
    model.eval()
    with torch.no_grad():
        losses = [
            position_losses(next_token_logits(model, batch), batch).mean(1)  # (B,)
            for batch in blocks.split(batch_size)
        ]
    return [round(x, 6) for x in torch.cat(losses).tolist()]


class Scores(pl.Callback):
    """Validation perplexity at each validation's step."""

    def __init__(self) -> None:
        self.ppl: dict[int, float] = {}

    def on_validation_end(self, trainer, module) -> None:
        self.ppl[trainer.global_step] = trainer.callback_metrics["val/ppl"].item()


def uptrain(
    model, datamodule, steps: int, every: int, anneal: bool, lr: float, teacher=None
) -> dict[int, float]:
    """Perplexity at step 0 and every ``every`` steps of ``steps`` of the one recipe at rate
    ``lr``; ``anneal``: the rate falls linearly to zero over the ``steps``, else it stays;
    ``teacher``: distil from it (its KL added to the loss)."""
    optimizer = functools.partial(torch.optim.AdamW, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = None
    if anneal:
        scheduler = functools.partial(
            torch.optim.lr_scheduler.LinearLR, start_factor=1.0, end_factor=0.0, total_iters=steps
        )
    module = LanguageModelModule(model.train(), optimizer, scheduler, teacher=teacher)
    scores = Scores()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, val_check_interval=every,
        check_val_every_n_epoch=None, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[scores],
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.validate(module, datamodule=datamodule, verbose=False)
    if steps:
        trainer.fit(module, datamodule=datamodule)
    return scores.ppl


def greedy_sample(model, tokenizer: Tokenizer, prompt: str) -> str:
    ids = torch.tensor([[tokenizer.bos_id, *tokenizer.encode(prompt)]])
    out = model.generate(
        input_ids=ids, max_new_tokens=20, do_sample=False,
        eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
    )  # fmt: skip
    return tokenizer.decode(out[0].tolist())


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    total = results["train_steps"]
    dashes = ("--", "-", "-.", ":", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 1)), (0, (3, 1, 1, 1)))
    styles = dict(zip(METHODS, dashes, strict=True))
    for row in results["rows"]:
        steps = sorted(int(s) for s in row["ppl"])
        frac = [100 * s / total for s in steps]
        color = {1.0: "black", 0.5: "C1", 0.25: "C2", 0.125: "C0"}.get(row["ratio_of_mha"])
        style = styles.get(row["method"], "-")
        ppl = [row["ppl"][str(s)] for s in steps]
        ax.plot(frac, ppl, linestyle=style, color=color, marker="o", ms=3, label=row["name"])
    ax.set_xlabel("uptraining steps, % of the original training's")
    ax.set_ylabel("validation perplexity")
    ax.set_yscale("log")
    distilled = ", distilled" if results["uptrain"].get("distill") else ""
    size = f"{results['parameters'] / 1e6:.1f}M" if "parameters" in results else "5.2M"
    ax.set_title(f"Llama-shaped LM ({size}), Multi30k en+de: converted, uptrained{distilled}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(results: dict) -> str:
    """The markdown table of ``results``: perplexity right after conversion and uptrained."""
    steps = results["uptrain"]["steps"]
    total = results["train_steps"]
    mha = next((r for r in results["rows"] if r["method"] == "mha"), None)
    head = ["design", "KV bytes/token", "of MHA", "converted"]
    head += [f"+{s} steps ({100 * s / total:g}%)" for s in steps]
    head += [f"vs MHA at +{steps[-1]}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results["rows"]:
        if row["method"] == "mha":
            how = ""
        elif row["method"] == "gqa":
            how = f" (G={row['value']})"
        elif split_method(row["method"])[0] == BUDGET_METHOD:  # each layer's: its "chosen"
            how = f" (cache_budget={row['value']:g})"
        else:
            keys = row.get("rotary_key") or row.get("selection")  # shared, or the pairs
            how = f" (r={row['value']}, rope_dim={row.get('rope_dim')}, {keys})"
        cells = [row["name"] + how, str(row["kv_bytes_per_token"]),
                 f"{row['ratio_of_mha']:g}", f"{row['ppl']['0']:.2f}"]  # fmt: skip
        cells += [f"{row['ppl'][str(s)]:.2f}" for s in steps]
        last = str(steps[-1])
        gap = 100 * (row["ppl"][last] / mha["ppl"][last] - 1) if mha else float("nan")
        cells.append(f"{gap:+.1f}%")
        lines.append("| " + " | ".join(cells) + " |")
    for row in results.get("unreachable", []):  # a ratio the design cannot reach
        lines.append(f"| {row['name']}: n/a, {row['why']} |" + " |" * (len(head) - 1))
    return "\n".join(lines) + "\n"


def row_name(method: str, ratio: int) -> str:
    """A converted row's name in results.json and in --only: ``gqa 1/4``."""
    return f"{method} 1/{ratio}"


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--data", help="the raw Multi30k directory (data.local_dir)")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.02, 0.05])
    parser.add_argument(
        "--anneal",
        action="store_true",
        help="the rate falls linearly to zero over the largest fraction's steps (the smaller "
        "fractions' scores are then mid-schedule); default: constant",
    )
    parser.add_argument("--only", nargs="*", help="names of the rows to run (default: all)")
    parser.add_argument("--lr", type=float, default=UPTRAIN_LR, help="the uptraining rate")
    parser.add_argument(
        "--methods", nargs="+", default=["gqa", "mla_svd"], metavar="METHOD",
        help=f"the converted rows beside MHA: {', '.join(METHODS)} or {FIXED_SPLIT}<d> (a "
        "fixed split of the budget); default: gqa mla_svd, issue 56's study",
    )  # fmt: skip
    parser.add_argument(
        "--distill",
        action="store_true",
        help="every row, MHA too, adds the KL to the trained model's predictions to its loss",
    )
    parser.add_argument(
        "--seed", type=int, default=0,
        help="the uptraining's seed: the order of its batches (the conversions do not change)",
    )  # fmt: skip
    args = parser.parse_args()
    check_study(args.methods, RATIOS, args.fractions)  # the translation study's check
    if not 0 < args.lr < 1:
        raise ValueError(f"--lr must be in (0, 1), got {args.lr}")
    rows = ["MHA"] + [row_name(method, ratio) for ratio in RATIOS for method in args.methods]
    if unknown := [name for name in args.only or [] if name not in rows]:
        # A misspelt row would otherwise be skipped without a word, and nothing run.
        raise ValueError(f"--only {unknown[0]!r} is not a row; expected some of {rows}")
    torch.manual_seed(args.seed)
    cfg = OmegaConf.load(args.run_dir / ".hydra" / "config.yaml")
    summary = json.loads((args.run_dir / "summary.json").read_text())
    data = dict(OmegaConf.to_container(cfg.data, resolve=False))
    data.pop("_target_")
    data.update(local_dir=args.data or data["local_dir"], cache_dir="outputs/cache", seed=args.seed)
    datamodule = LanguageModelDataModule(**data)
    datamodule.setup("fit")
    tokenizer = Tokenizer.load(args.run_dir / "tokenizer.json")
    if tokenizer.fingerprint() != datamodule.tokenizer.fingerprint():
        raise SystemExit(
            f"error: {args.run_dir}'s tokenizer is not the data's; same data settings?"
        )
    model = LlamaForCausalLM.from_pretrained(args.run_dir / "hf")
    unswapped = batch_loss(model, datamodule.blocks["validation"][:16])
    replace_hf_attention(model)
    swapped = batch_loss(model, datamodule.blocks["validation"][:16])
    calibration_batch = datamodule.blocks["train"][:16]
    calibration = {"input_ids": calibration_batch, "use_cache": False}
    mha_bytes = cache_bytes(model)
    steps = [round(f * summary["steps"]) for f in args.fractions]
    every = math.gcd(*steps)

    layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    kv_heads = layers[0].num_kv_heads
    plan, grid, unreachable = [("MHA", "mha", None, {})], [], []
    for ratio in RATIOS:
        budget = mha_bytes // ratio // 4 // len(layers)  # floats per token and layer
        for method in args.methods:
            name = row_name(method, ratio)
            base, width = split_method(method)
            if base == BUDGET_METHOD:  # the split measured by convert_attention (or named)
                try:
                    for attn in layers:
                        named = ROTARY_DEFAULTS | {"rope_dim": width}  # None: measured
                        budget_numbers(attn, 1 / ratio, options=named)
                except ValueError as error:
                    unreachable.append({"name": name, "why": str(error)})
                    continue
                plan.append((name, method, 1 / ratio, {}))
                continue
            if method == "gqa":
                if kv_heads % ratio == 0:
                    plan.append((name, "gqa", kv_heads // ratio, {}))
                else:
                    why = f"{kv_heads} K/V heads do not pool into 1/{ratio} as many"
                    unreachable.append({"name": name, "why": why})
                continue
            shared = MLA_METHODS[method].get("rotary_key") == "shared"
            tried = []
            for rope_dim in ROPE_DIMS:
                r = budget - kv_heads * rope_dim  # a shared key: the groups' numbers in one
                if r < 1:  # the rotary keys alone fill the budget
                    continue
                for selection in ("high",) if shared else SELECTIONS:
                    options = (
                        {"rope_dim": kv_heads * rope_dim}
                        if shared
                        else {"rope_dim": rope_dim, "selection": selection}
                    )
                    m, _ = convert(model, method, r, calibration, **options)
                    loss = batch_loss(m, calibration_batch)
                    tried.append({"method": method, "ratio": ratio, "r": r, **options,
                                  "calibration_loss": loss})  # fmt: skip
            grid += tried
            if not tried:
                why = f"{budget} numbers per token and layer hold no latent beside the rotary keys"
                unreachable.append({"name": name, "why": why})
                continue
            best = min(tried, key=lambda t: t["calibration_loss"])
            options = {k: best[k] for k in ("rope_dim", "selection") if k in best}
            plan.append((name, method, best["r"], options))

    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "results.json"
    try:
        results = json.loads(out.read_text()) if out.exists() else {"rows": []}
    except json.JSONDecodeError as err:
        raise ValueError(f"{out} is not JSON ({err}); expected convert_lm.py's results") from None
    recipe = {"optimizer": "AdamW(betas=(0.9, 0.95), weight_decay=0.1)", "lr": args.lr,
              "schedule": "linear to 0" if args.anneal else "constant", "steps": steps,
              "batch": f"{datamodule.batch_size} x {datamodule.block_size} tokens",
              "distill": args.distill, **({"seed": args.seed} if args.seed else {})}  # fmt: skip
    if results["rows"] and results["uptrain"] != recipe:
        # A row already there was uptrained otherwise: continuing would mix two recipes.
        raise ValueError(
            f"{out} holds rows uptrained with {results['uptrain']}, not {recipe}; "
            "use another OUT_DIR"
        )
    results.update(
        run_dir=str(args.run_dir), train_steps=summary["steps"], trained_ppl=summary["val/ppl"],
        uptrain=recipe,
        swap_check={"unswapped_val_batch_loss": unswapped, "swapped_val_batch_loss": swapped},
        mha_bytes_per_token=mha_bytes, mla_selection_grid=grid, unreachable=unreachable,
        parameters=sum(p.numel() for p in model.parameters()),
    )  # fmt: skip
    done = {row["name"] for row in results["rows"]}
    teacher = copy.deepcopy(model).eval() if args.distill else None  # the trained model
    for name, kind, value, options in plan:
        if (args.only and name not in args.only) or name in done:
            continue
        start, began = time.time(), time.process_time()
        m, report = convert(model, kind, value, calibration, **options)
        convert_seconds = round(time.process_time() - began, 2)
        errors = {key: [row[key] for row in report] for key in ("k_error", "v_error", "out_error")}
        if any("candidates" in layer for layer in report):  # the default: what it measured
            errors["chosen"] = [{**layer["latent"], "candidates": layer["candidates"]}
                                for layer in report]  # fmt: skip
        held_out = datamodule.blocks["validation"]
        converted = block_losses(m, held_out, datamodule.batch_size)
        ppl = uptrain(m, datamodule, max(steps), every, args.anneal, args.lr, teacher)
        blocks = {"0": converted, str(max(steps)): block_losses(m, held_out, datamodule.batch_size)}
        for step, losses in blocks.items():  # the pairing unit reproduces the trainer's score
            mean = sum(losses) / len(losses)
            if not math.isclose(math.exp(mean), ppl[int(step)], rel_tol=1e-4):
                raise RuntimeError(f"{name}: held-out blocks give ppl {math.exp(mean):.4f} "
                                   f"at step {step}, the trainer {ppl[int(step)]:.4f}")  # fmt: skip
        row = {
            "name": name, "method": kind, "value": value,
            **MLA_METHODS.get(split_method(kind)[0], {}), **options,
            "kv_bytes_per_token": cache_bytes(m), "ratio_of_mha": cache_bytes(m) / mha_bytes,
            "ppl": {str(s): p for s, p in ppl.items()}, "block_loss": blocks, **errors,
            "seconds": round(time.time() - start), "convert_cpu_seconds": convert_seconds,
            "greedy_sample": greedy_sample(m.eval(), tokenizer, "A man"),
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        results["rows"].append(row)
        text = json.dumps(results, indent=1) + "\n"  # a kill mid-write keeps the rows before
        write_atomically(out, lambda f, text=text: f.write(text.encode()))
    plot(results, args.out_dir / "uptraining.png")
    (args.out_dir / "table.md").write_text(table(results))


if __name__ == "__main__":
    main()
