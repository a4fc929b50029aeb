r"""The training step of two source trees side by side, against the fp32 GEMM peak of the same run.

    git worktree add /tmp/old 25fe9c2
    python scripts/benchmark_trees.py --old /tmp/old --new . --threads 2 --rounds 5 \
        experiment=multi30k_en_de data.local_dir=/work/shared/data/multi30k

Each round runs ``scripts/benchmark_training.py --precisions 32-true`` of each tree in its own
process, with that tree's ``src`` on the path (the order alternates from round to round, so
drift on the machine hits both trees alike), then measures the fp32 GEMM rates in this process:
a 2048^3 product (the peak) and the recipe's forward GEMM shapes, ``max_tokens`` rows by
``d_model``, ``ffn_dim`` and the vocabulary (composed from the new tree's configs with the same
overrides). It prints each rate, and each tree's seconds and GFLOP/s per step (medians over the
rounds), its fraction of the 2048^3 peak, and the new tree's speed over the old one's. Give
``data.local_dir`` as an absolute path: each tree runs from its own directory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from multihead.cli import register_resolvers

import torch
from hydra import compose, initialize_config_dir

from multihead.timing import interleaved_medians

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")
register_resolvers()  # as scripts/train.py does


def tree_step(tree: Path, overrides: list[str], threads: int, steps: int) -> dict[str, float]:
    """``{"s/step", "GFLOP/step"}`` of ``tree``'s fp32 training step, from its own
    ``benchmark_training.py`` (median of 3 blocks of ``steps`` steps) in a fresh process."""
    command = [
        sys.executable,
        "scripts/benchmark_training.py",
        *overrides,
        "--precisions",
        "32-true",
        "--threads",
        str(threads),
        "--steps",
        str(steps),
        "--blocks",
        "3",
        "--no-peak",
    ]
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"benchmark_trees: {tree}: {out.stderr.strip().splitlines()[-1]}")
    lines = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    row = [cell.strip() for cell in lines[1].strip("|").split("|")]
    return {key: float(row[header.index(key)]) for key in ("s/step", "GFLOP/step")}


def gemm_rates(shapes: dict[str, tuple[int, int, int]]) -> dict[str, float]:
    """GFLOP/s of ``(M, K) @ (K, N)`` per named shape, fp32, medians of 5 interleaved calls."""
    operands = {name: (torch.randn(m, k), torch.randn(k, n)) for name, (m, k, n) in shapes.items()}
    jobs = {name: (lambda a=a, b=b: a @ b) for name, (a, b) in operands.items()}
    seconds = interleaved_medians(jobs, 5)
    return {name: 2 * m * k * n / seconds[name] / 1e9 for name, (m, k, n) in shapes.items()}


def commit(tree: Path) -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True
    )
    return out.stdout.strip() or "?"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both trees")
    parser.add_argument("--old", type=Path, required=True, help="the old source tree")
    parser.add_argument("--new", type=Path, default=Path("."), help="the new source tree")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    for name, tree in trees.items():
        if not (tree / "scripts" / "benchmark_training.py").is_file():
            raise SystemExit(
                f"benchmark_trees: --{name} {tree}; expected a source tree with "
                "scripts/benchmark_training.py"
            )
    torch.set_num_threads(args.threads)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=args.overrides)
    m, e, f, v = cfg.data.max_tokens, cfg.model.d_model, cfg.model.ffn_dim, cfg.data.vocab_size
    shapes = {
        "2048 x 2048 x 2048 (the peak)": (2048, 2048, 2048),
        f"{m} x {e} x {e} (attention projections)": (m, e, e),
        f"{m} x {e} x {f} (FFN in)": (m, e, f),
        f"{m} x {f} x {e} (FFN out)": (m, f, e),
        f"{m} x {e} x {v} (vocabulary)": (m, e, v),
    }

    steps: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    rates: dict[str, list[float]] = {name: [] for name in shapes}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            steps[name].append(tree_step(trees[name], args.overrides, args.threads, args.steps))
        for shape, rate in gemm_rates(shapes).items():
            rates[shape].append(rate)
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    rate = {shape: statistics.median(each) for shape, each in rates.items()}
    peak = rate[next(iter(shapes))]
    print(
        f"\ntorch {torch.__version__}, {args.threads} threads, {args.rounds} rounds, "
        f"{' '.join(args.overrides)}"
    )
    print("| fp32 GEMM (M x K x N) | GFLOP/s |\n|---|---:|")
    for shape, gflops in rate.items():
        print(f"| {shape} | {gflops:.0f} |")
    print("\n| tree | commit | GFLOP/step | s/step | GFLOP/s | of peak |")
    print("|---|---|---:|---:|---:|---:|")
    seconds = {}
    for name, tree in trees.items():
        seconds[name] = statistics.median(s["s/step"] for s in steps[name])
        gflop = steps[name][0]["GFLOP/step"]
        print(
            f"| {name} {tree} | {commit(tree)} | {gflop:.3g} | {seconds[name]:.3f} | "
            f"{gflop / seconds[name]:.0f} | {gflop / seconds[name] / peak:.0%} |"
        )
    print(f"\nnew/old speed: {seconds['old'] / seconds['new']:.2f}x (old s/step over new s/step)")


if __name__ == "__main__":
    main()
