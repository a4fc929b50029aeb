"""Benchmark sparse heads (MoH top-k) against the dense layer: time and FLOPs.

Every candidate is measured in one run, interleaved (each repeat times every candidate once,
in turn), so a noisy machine slows them alike; ratios are against the dense layer of the
same run. Figures, for one forward+backward of causal self-attention:

* the median time over ``--repeats``;
* the FLOPs that ``torch.utils.flop_counter.FlopCounterMode`` counts, on a twin of each
  layer with the ``math`` backend (whose matmuls it sees; it does not see inside SDPA's
  CPU kernel), masked scores included; the gate's top-k, gathers and scatters are not
  FLOPs;
* ``C / L``: the most tokens any (sentence, routed head) got over the sequence length,
  which sets the packed size the sparse layer computes (``k / R`` for a balanced router).

The sparse layers' gates are as initialised (random), so routing is roughly but not
exactly balanced. Example (the table of docs/benchmarks.md)::

    python scripts/benchmark_heads.py --threads 1
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from multihead import MultiHeadAttention
from multihead.attention import BACKENDS
from multihead.timing import interleaved_medians


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embed-dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--backend", default="sdpa", help=f"one of {', '.join(BACKENDS)}")
    parser.add_argument(
        "--top-k",
        type=int,
        nargs="+",
        default=None,
        help="routed heads per token to compare (default: H/2 and H/4)",
    )
    parser.add_argument(
        "--shared", type=int, default=0, help="always-on heads of the sparse layers"
    )
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("embed_dim", "heads", "batch", "length", "repeats"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.backend not in BACKENDS:
        parser.error(f"unknown --backend {args.backend!r}; expected one of {', '.join(BACKENDS)}")
    if args.top_k is None:
        args.top_k = [k for k in (args.heads // 2, args.heads // 4) if k > 0]
    return args


def build(args: argparse.Namespace, backend: str) -> dict[str, MultiHeadAttention]:
    """The dense layer and one sparse layer per ``--top-k``, same weights (same seed)."""
    layers = {}
    for k in [None, *args.top_k]:
        torch.manual_seed(args.seed)
        moh = {"design": "moh", "top_k_heads": k, "num_shared_heads": args.shared}
        options = {} if k is None else moh
        layer = MultiHeadAttention(args.embed_dim, args.heads, backend=backend, **options)
        layers[layer.head_tag] = layer
    return layers


def packed_share(layer: MultiHeadAttention, x: torch.Tensor) -> float:
    """``C / L`` of a sparse layer on ``x`` (1.0 for the dense layer)."""
    if layer.design is None:
        return 1.0
    gate = layer.design  # the sparse heads' router, an nn.Linear E -> R
    with torch.no_grad():
        chosen = gate(x).topk(gate.top_k, dim=-1).indices  # (B, L, k)
    routed = gate.out_features
    counts = torch.stack([(chosen == h).sum(dim=(1, 2)) for h in range(routed)])  # (R, B)
    return counts.max().item() / x.shape[1]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        layers, counted = build(args, args.backend), build(args, "math")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed + 1)
    x = torch.randn(args.batch, args.length, args.embed_dim, requires_grad=True)

    def step(layer: MultiHeadAttention) -> Callable[[], None]:
        def run() -> None:
            layer(x, is_causal=True).sum().backward()

        return run

    flops = {}
    for name, layer in counted.items():
        with FlopCounterMode(display=False) as counter:
            step(layer)()
        flops[name] = counter.get_total_flops()
    times = interleaved_medians(
        {name: step(layer) for name, layer in layers.items()}, args.repeats, warmup=args.warmup
    )

    print(
        f"Causal self-attention, forward+backward, E={args.embed_dim}, H={args.heads}, "
        f"B={args.batch}, L={args.length}, backend={args.backend}, "
        f"threads={torch.get_num_threads()}, median of {args.repeats}\n"
    )
    print("| layer | active heads | C / L | GFLOPs | FLOPs vs dense | ms | time vs dense |")
    print("|---|---|---|---|---|---|---|")
    dense = next(iter(layers))
    for name, layer in layers.items():
        print(
            f"| {name} | {layer.active_head_fraction:.3f} | {packed_share(layer, x):.2f} "
            f"| {flops[name] / 1e9:.2f} | {flops[name] / flops[dense]:.2f} "
            f"| {times[name] * 1e3:.1f} | {times[name] / times[dense]:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
