r"""Training-step throughput of the project's model, per precision, measured in one run.

    python scripts/benchmark_training.py data.local_dir=../shared/data/multi30k [overrides]

Composes configs/train.yaml with the overrides (so model, attention and batching are the
ones a real run uses), then times forward + backward + Adam step on real Multi30k batches.
Every variant (each precision times each ``--variants`` entry, and each again compiled with
``--compile``) is timed block by block, interleaved, so machine noise hits them alike. It
prints real (non-padding) target and source tokens per second, the ratio to the first
variant, and the model's GFLOP per step (counted on the unfused step, all positions) as
GFLOP/s and as a fraction of the fp32 GEMM peak measured in the same run (``--peak``; with
``bf16-mixed`` among the precisions, the bf16 GEMM rate of the same 2048^3 product too).
``--device cuda`` times on the GPU (``--precisions 32-true bf16-mixed 16-mixed`` there; fp16
scales the loss as Lightning's 16-mixed does).

A variant is ``step`` (the training module's own loss) or ``+``-joined options:
``unfused`` (the full ``(B, T, V)`` logits into ``F.cross_entropy``, the step before the fused
loss), ``chunk=N`` (:func:`~multihead.training.loss.linear_cross_entropy` with that chunk
size), ``adam-loop`` (``Adam(fused=False)``, the per-tensor loop). ``unfused+adam-loop`` is
the step before either change. E.g.

    python scripts/benchmark_training.py data.local_dir=../shared/data/multi30k \
        experiment=multi30k_en_de --threads 1 --variants unfused+adam-loop step chunk=256

``--profile`` also prints, for each variant, where one block of ``--steps`` steps spends its
time: self CPU time and share per op from ``torch.profiler`` (GEMMs and the attention kernels
each summed into one row, ops under 1% into "everything else"), e.g.

    python scripts/benchmark_training.py data.local_dir=../shared/data/multi30k \
        experiment=multi30k_en_de --precisions 32-true --threads 2 --profile

``--attention A B ...`` times the same steps once per attention preset (``configs/attention``),
interleaved too, each with its own parameter count and FLOPs: the training cost of head
designs, e.g. ``experiment=compare_heads --attention mha_h8 gqa_h8_kv2 mqa_h8 mla_h8_r32``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from pathlib import Path

from multihead.cli import register_resolvers

import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import MissingConfigException
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict
from torch.utils.flop_counter import FlopCounterMode

from multihead.model import build_model
from multihead.timing import interleaved_medians, op_shares, wall_seconds
from multihead.training.loss import linear_cross_entropy

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")


def attention_presets() -> list[str]:
    return sorted(p.stem for p in (Path(CONFIG_DIR) / "attention").glob("*.yaml"))


register_resolvers()  # as scripts/train.py does


def autocast(precision: str, device: torch.device):
    if precision == "32-true":
        return contextlib.nullcontext()
    if precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "16-mixed" and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.float16)
    expected = (
        "32-true, bf16-mixed or 16-mixed" if device.type == "cuda" else "32-true or bf16-mixed"
    )
    raise ValueError(f"precision {precision!r}; expected {expected} on {device.type}")


VARIANT_WORDS = ("step", "unfused", "chunk=N", "adam-loop")


def parse_variant(spec: str) -> dict:
    """``"chunk=256+adam-loop"`` -> the options of :func:`loss_fn` and the optimiser."""
    options = {"unfused": False, "fused_loss": {}, "optimizer": {}}
    for word in spec.split("+"):
        if word == "step":
            continue
        elif word == "unfused":
            options["unfused"] = True
        elif word.startswith("chunk=") and word[6:].isdigit():
            options["fused_loss"]["chunk_size"] = int(word[6:])
        elif word == "adam-loop":
            options["optimizer"]["fused"] = False
        else:
            raise ValueError(f"variant word {word!r} in {spec!r}; expected {VARIANT_WORDS}")
    if options["unfused"] and options["fused_loss"]:
        raise ValueError(f"variant {spec!r}: unfused takes no chunk=")
    return options


def loss_fn(module, batch: dict, options: dict) -> torch.Tensor:
    """The training loss of ``batch`` as the variant computes it."""
    if not (options["unfused"] or options["fused_loss"]):
        return module.loss(batch)[0]
    tgt_in, tgt_out = batch["tgt"][:, :-1], batch["tgt"][:, 1:]
    if options["unfused"]:
        logits = module.model(batch["src"], tgt_in)  # (B, T, V)
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            tgt_out.reshape(-1),
            ignore_index=module.pad_id,
            label_smoothing=module.label_smoothing,
        )
    states = module.model.decoder_states(batch["src"], tgt_in)  # (B, T, E)
    loss, _ = linear_cross_entropy(
        states,
        module.model.output_projection.weight,
        tgt_out,
        ignore_index=module.pad_id,
        label_smoothing=module.label_smoothing,
        **options["fused_loss"],
    )
    return loss


def gemm_peak(device: torch.device, dtype: torch.dtype, size: int = 2048) -> float:
    """GFLOP/s of a square ``size`` GEMM, the median of 5 after a warm-up."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    seconds = interleaved_medians({"gemm": lambda: a @ b}, 5, device=device)["gemm"]
    return 2 * size**3 / seconds / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for configs/train.yaml")
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=4, help="timed blocks per precision")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    parser.add_argument(
        "--variants", nargs="+", default=["step"], help=f"+-joined words of {VARIANT_WORDS}"
    )
    parser.add_argument(
        "--attention", nargs="+", default=[None], help="attention presets to time, each a variant"
    )
    parser.add_argument(
        "--compile", action="store_true", help="also time each variant with torch.compile"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print each variant's self CPU time per op over one block (torch.profiler)",
    )
    parser.add_argument(
        "--peak",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the fp32 GEMM peak (a 2048^3 matmul) for the fraction-of-peak column",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = torch.device(args.device)
    except RuntimeError:  # not a device name at all
        device = torch.device("meta")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"benchmark_training: --device {args.device}; expected cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"benchmark_training: --device {args.device}, but CUDA is not available")
    for precision in args.precisions:
        try:
            autocast(precision, device)
        except ValueError as err:
            raise SystemExit(f"benchmark_training: {err}") from None
    try:
        specs = {spec: parse_variant(spec) for spec in args.variants}
    except ValueError as err:
        raise SystemExit(f"benchmark_training: {err}") from None

    overrides = ["paths.output_dir=outputs/benchmark", *args.overrides]
    cfgs = {}  # attention preset (None: as composed) -> its config
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        for preset in args.attention:
            try:
                cfgs[preset] = compose(
                    "train",
                    overrides=overrides + ([f"attention={preset}"] if preset else []),
                    return_hydra_config=True,
                )
            except MissingConfigException:
                raise SystemExit(
                    f"benchmark_training: --attention {preset}; expected a preset of "
                    f"configs/attention ({', '.join(attention_presets())})"
                ) from None
    cfg = cfgs[args.attention[0]]  # the data and seed: the presets change only the attention
    HydraConfig.instance().set_config(cfg)  # for ${hydra:...} in configs, as in a real run
    for each in cfgs.values():
        with open_dict(each):
            del each["hydra"]  # Hydra's own settings: resolvable only inside a Hydra job
    torch.manual_seed(cfg.seed)
    dm = instantiate(cfg.data)
    dm.setup("fit")
    batches = []
    for batch in dm.train_dataloader():
        batches.append({k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()})
        if len(batches) == args.steps:
            break
    pad = dm.pad_id
    tgt_tokens = sum(int((b["tgt"][:, 1:] != pad).sum()) for b in batches)
    src_tokens = sum(int((b["src"] != pad).sum()) for b in batches)

    variants = [(a, p, s, False) for a in cfgs for p in args.precisions for s in specs]
    if args.compile:
        variants += [(a, p, s, True) for a in cfgs for p in args.precisions for s in specs]
    runs, step_gflop = {}, {}
    for preset, precision, spec, compiled in variants:
        torch.manual_seed(cfg.seed)
        config = OmegaConf.to_container(cfgs[preset], resolve=True)
        model = build_model(config, dm.vocab_size, pad)
        model.to(device)
        if compiled:
            # Batches differ in shape (token buckets): compile for dynamic shapes up front.
            # The loss calls decoder_states (the fused loss) or forward (unfused).
            model.decoder_states = torch.compile(model.decoder_states, dynamic=True)
            model.compile(dynamic=True)
        module = instantiate(cfg.module, model=model, tokenizer=dm.tokenizer)
        options = specs[spec]
        # Not configure_optimizers(): its scheduler may need a Trainer (cooldown_minutes).
        optimizer = module.optimizer_factory(module.parameters(), **options["optimizer"])
        # fp16 needs loss scaling (as Lightning's 16-mixed); a disabled scaler is a no-op.
        scaler = torch.amp.GradScaler(device.type, enabled=precision == "16-mixed")
        words = [preset] if preset else []
        name = " ".join(words + [precision, spec] + (["+ compile"] if compiled else []))
        runs[name] = (precision, options, module.train(), optimizer, scaler)
        if preset not in step_gflop:
            # The model's FLOPs: the unfused step's GEMMs and attention over all positions,
            # so every variant of one model is measured against the same work.
            with FlopCounterMode(display=False) as counter:
                for batch in batches:
                    loss_fn(module, batch, parse_variant("unfused")).backward()
            module.zero_grad(set_to_none=True)
            step_gflop[preset] = counter.get_total_flops() / len(batches) / 1e9

    def step_block(name: str) -> None:
        precision, options, module, optimizer, scaler = runs[name]
        for batch in batches:
            with autocast(precision, device):
                loss = loss_fn(module, batch, options)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)

    blocks = {name: functools.partial(step_block, name) for name in runs}
    for name, block in blocks.items():  # warm-up (and compilation), timed to show its cost
        print(
            f"warm-up (and compilation) of {name}: {wall_seconds(block, device):.1f} s", flush=True
        )
    if args.profile:
        for name, block in blocks.items():
            print(f"\nprofile of {name}, one block of {len(batches)} steps:")
            print("| op | self CPU | share |\n|---|---:|---:|")
            for op, seconds, share in op_shares(block):
                print(f"| {op} | {seconds:.3f} s | {share:.1%} |")
        print()
    peak = gemm_peak(device, torch.float32) if args.peak else None
    # bf16's own GEMM rate beside it, when bf16 is timed: whether its GEMMs are faster at all.
    bf16_peak = (
        gemm_peak(device, torch.bfloat16) if peak and "bf16-mixed" in args.precisions else None
    )
    times = interleaved_medians(blocks, args.blocks, warmup=0, device=device)

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"torch {torch.__version__}, {where}, {torch.get_num_threads()} threads, "
        f"{len(batches)} batches of <= {cfg.data.max_tokens} tokens"
        + (f", fp32 GEMM peak {peak:.0f} GFLOP/s" if peak else "")
        + (f", bf16 GEMM (2048^3) {bf16_peak:.0f} GFLOP/s" if bf16_peak else "")
    )
    print(
        "| variant | params | GFLOP/step | s/step | target tok/s | src+tgt tok/s | GFLOP/s "
        "| of peak | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    base = None
    for (preset, *_), name in zip(variants, runs, strict=True):
        seconds = times[name]
        base = base or seconds
        gflops = step_gflop[preset] * len(batches) / seconds
        params = runs[name][2].model.num_parameters()
        print(
            f"| {name} | {params:,} | {step_gflop[preset]:.3g} | {seconds / len(batches):.3f} | "
            f"{tgt_tokens / seconds:,.0f} | {(src_tokens + tgt_tokens) / seconds:,.0f} | "
            f"{gflops:.0f} | {f'{gflops / peak:.0%}' if peak else '-'} | {base / seconds:.2f}x |"
        )


if __name__ == "__main__":
    main()
