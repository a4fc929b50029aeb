"""Lever probe (issue 42): one beam-5 decoder step at fixed shapes, eager vs torch.compile
with static caches, and fp32 GEMM throughput of the step's shapes, MKL vs oneDNN.

    python scripts/probe_decode_step.py CKPT [--threads 2]

128 sentences x 5 beams = 640 rows, 20 source tokens, 15 positions already cached.
"""

import argparse
import time

import torch
import torch.nn.functional as F

from multihead.checkpoints import load_trained_model
from multihead.model.transformer import DecoderCache

N, K, S, T, STEP = 128, 5, 20, 40, 15


def median_seconds(fn, reps=30):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def gemms() -> None:
    shapes = [
        (640, 128, 8000, "output projection, beam 5"),
        (128, 128, 8000, "output projection, greedy"),
        (640, 128, 384, "Q/K/V"),
        (640, 128, 256, "FFN up"),
        (640, 256, 128, "FFN down"),
    ]
    for rows, k, n, what in shapes:
        x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        mkl = median_seconds(lambda x=x, w=w, b=b: F.linear(x, w, b))
        dnn = median_seconds(
            lambda x=x, p=packed, b=b: torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "")
        )
        gflop = 2 * rows * k * n / 1e9
        print(
            f"{what:28s} {rows}x{k}x{n}: MKL {gflop / mkl:6.1f} GFLOP/s, "
            f"oneDNN {gflop / dnn:6.1f} GFLOP/s"
        )


def step_ms(model, src, static: bool, compiled: bool) -> tuple[float, float]:
    memory, pad = model.encode(src)
    layers = model.decoder_layers
    caches = DecoderCache(
        [layer.self_attn.make_kv_cache(N * K, T, static=static) for layer in layers],
        [layer.cross_attn.make_kv_cache(N, S, static=static) for layer in layers],
    )
    tokens = torch.randint(4, model.output_projection.out_features, (N * K, 1))

    def step():
        return model.decode(tokens, memory, pad, caches)

    fn = torch.compile(step, dynamic=False) if compiled else step
    start = time.perf_counter()
    for _ in range(STEP):  # fill the caches (and compile)
        fn()
    fill = time.perf_counter() - start

    def again():
        for cache in caches.self_caches:  # back to STEP positions
            if static:
                cache.position.fill_(STEP)
            else:
                cache.size = STEP
        fn()

    return fill, median_seconds(again, reps=20) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_trained_model(args.ckpt).model.eval()
    torch.manual_seed(0)
    src = torch.randint(4, model.output_projection.out_features, (N, S))
    with torch.inference_mode():
        gemms()
        for name, static, compiled in [
            ("eager", False, False),
            ("eager, static cache", True, False),
            ("compiled, static cache", True, True),
            ("eager", False, False),
        ]:
            fill, ms = step_ms(model, src, static, compiled)
            print(f"{name:24s} first {STEP} steps {fill:6.2f} s, one step {ms:6.2f} ms")


if __name__ == "__main__":
    main()
