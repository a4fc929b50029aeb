"""Training-step throughput of the project's model, per precision, measured in one run.

    python scripts/benchmark_training.py data.local_dir=../shared/data/multi30k [overrides]

Composes configs/train.yaml with the overrides (so model, attention and batching are the
ones a real run uses), then times forward + backward + Adam step on real Multi30k batches.
Precisions are interleaved block by block, so machine noise hits them alike. It prints
real (non-padding) target and source tokens per second and the ratio to the first precision.
``--compile`` adds each precision again with the model's forward under ``torch.compile``.
``--device cuda`` times on the GPU (``--precisions 32-true bf16-mixed 16-mixed`` there; fp16
scales the loss as Lightning's 16-mixed does).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from multihead.checkpoints import build_model

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")


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


def label(precision: str, compiled: bool) -> str:
    return f"{precision} + compile" if compiled else precision


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for configs/train.yaml")
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=4, help="timed blocks per precision")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    parser.add_argument(
        "--compile", action="store_true", help="also time each precision with torch.compile"
    )
    args = parser.parse_args()
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

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["paths.output_dir=outputs/benchmark", *args.overrides])
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

    variants = [(p, False) for p in args.precisions]
    if args.compile:
        variants += [(p, True) for p in args.precisions]
    runs = {}
    for precision, compiled in variants:
        torch.manual_seed(cfg.seed)
        model = build_model(OmegaConf.to_container(cfg, resolve=True), dm.vocab_size, pad)
        model.to(device)
        if compiled:
            # Batches differ in shape (token buckets): compile for dynamic shapes up front.
            model.compile(dynamic=True)
        module = instantiate(cfg.module, model=model, tokenizer=dm.tokenizer)
        optimizer = module.configure_optimizers()["optimizer"]
        # fp16 needs loss scaling (as Lightning's 16-mixed); a disabled scaler is a no-op.
        scaler = torch.amp.GradScaler(device.type, enabled=precision == "16-mixed")
        runs[label(precision, compiled)] = (precision, module.train(), optimizer, scaler)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step_block(name: str) -> float:
        precision, module, optimizer, scaler = runs[name]
        sync()
        start = time.perf_counter()
        for batch in batches:
            with autocast(precision, device):
                loss, _ = module.loss(batch)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - start

    for name in runs:  # warm-up (and compilation)
        step_block(name)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.blocks):
        for name in runs:
            times[name].append(step_block(name))

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"torch {torch.__version__}, {where}, {torch.get_num_threads()} threads, "
        f"{len(batches)} batches of <= {cfg.data.max_tokens} tokens, "
        f"params {next(iter(runs.values()))[1].model.num_parameters():,}"
    )
    print("| precision | s/step | target tok/s | src+tgt tok/s | ratio |")
    print("|---|---|---|---|---|")
    base = None
    for name in runs:
        seconds = statistics.median(times[name])
        base = base or seconds
        print(
            f"| {name} | {seconds / len(batches):.3f} | {tgt_tokens / seconds:,.0f} | "
            f"{(src_tokens + tgt_tokens) / seconds:,.0f} | {base / seconds:.2f}x |"
        )


if __name__ == "__main__":
    main()
