"""What the measured default of convert_attention costs against a plain conversion (issue 74).

    python scripts/benchmark_conversion.py [--repeats 3] [--threads 1] [--ratio 8]

The LM study's model shape (``configs/train_lm.yaml``: a Llama of hidden 256, 4 layers, 8
heads of 32, SwiGLU 688, 8,000 ids; random weights: the time does not depend on them),
swapped by ``replace_hf_attention``, converted at ``1/ratio`` of its cache (per-group keys
of 2 rotated features, the latent the rest) with the LM study's calibration (16 blocks of
128 token ids) three ways, alternating, each on a fresh copy of the model:

* ``weights only``: every choice named (SVD, no balancing, per-group keys), no calibration;
* ``named, calibrated``: the same with the calibration, which then only measures the
  report's errors (one calibration pass, and each layer's output on it);
* ``measured default``: nothing named: each layer converted 8 ways (SVD or PCA, with or
  without K/V balancing, per-group or one shared key), each scored by the model's loss on
  the held-out 4 blocks (32 forward passes of 4 blocks), the best kept;
* ``measured budget``: ``cache_budget=1/ratio`` instead of ``r`` and ``rope_dim``: the 8
  ways times each split the budget allows (per-group keys of one pair, R/8, R/4, R/2 of the
  32 rotated features, or a shared key of 8 times that; the latent the rest): at 1/8, 2
  splits (16 candidates a layer), at 1/4, 3 (24), at 1/2, 4 (32).

Prints the median CPU seconds of each (``time.process_time``: on one thread the wall time
of a quiet machine, and unmoved by other jobs sharing the cores) and their ratio to
``named, calibrated``, and the median wall seconds beside.
"""

import argparse
import copy
import statistics
import time

import multihead.cli  # noqa: F401  (names the train extra when it is missing)

import torch

from multihead.checkpoints.conversion import convert_attention
from multihead.integrations.huggingface import replace_hf_attention
from multihead.integrations.llama import build_llama_lm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ratio", type=int, default=8, help="MHA's cache over the latent's")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_llama_lm(
        vocab_size=8000, hidden_size=256, num_layers=4, num_heads=8, intermediate_size=688,
        max_positions=128, seed=0,
    ).eval()  # fmt: skip
    replace_hf_attention(model)
    ids = torch.randint(3, 8000, (16, 128), generator=torch.Generator().manual_seed(0))
    calibration = {"input_ids": ids, "use_cache": False}
    heads, head_dim, rope_dim = 8, 32, 2
    r = 2 * heads * head_dim // args.ratio - heads * rope_dim
    named = {"factorisation": "svd", "balance_kv": False, "rotary_key": "per_group"}
    size = {"kv_latent": r, "rope_dim": rope_dim}
    ways = {
        "weights only": {**size, **named},
        "named, calibrated": {**size, **named, "calibration": calibration},
        "measured default": {**size, "calibration": calibration},
        "measured budget": {"cache_budget": 1 / args.ratio, "calibration": calibration},
    }
    cpu: dict[str, list[float]] = {way: [] for way in ways}
    wall: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(args.repeats):
        for way, options in ways.items():
            fresh = copy.deepcopy(model)
            start, start_cpu = time.perf_counter(), time.process_time()
            convert_attention(fresh, **options)
            cpu[way].append(time.process_time() - start_cpu)
            wall[way].append(time.perf_counter() - start)
    base = statistics.median(cpu["named, calibrated"])
    print(f"1/{args.ratio} of the cache (r = {r}, per-group rope_dim {rope_dim}), "
          f"{args.threads} thread(s), median of {args.repeats}")  # fmt: skip
    print("| conversion | CPU s | vs named, calibrated | wall s |\n|---|---:|---:|---:|")
    for way in ways:
        median, seconds = statistics.median(cpu[way]), statistics.median(wall[way])
        print(f"| {way} | {median:.2f} | {median / base:.1f}x | {seconds:.2f} |")


if __name__ == "__main__":
    main()
