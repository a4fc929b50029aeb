"""Benchmark MultiHeadAttention against torch.nn.MultiheadAttention and a textbook layer.

All candidates are measured in one run, interleaved (every repeat times each candidate
once, in turn), so a noisy machine slows them alike; ratios are taken against
``torch.nn.MultiheadAttention`` measured in the same run.

Figures:

* forward+backward time of causal self-attention (median of ``--repeats``);
* peak memory of one forward+backward at ``--memory-len``. On CUDA:
  ``torch.cuda.max_memory_allocated`` above what was allocated before. On CPU: the peak of
  the CPU allocator's live bytes as recorded by ``torch.profiler`` (``profile_memory=True``;
  the ``total_allocated`` field of its allocation events), counting only tensors allocated
  during the pass (parameters and the input are excluded, the output and gradients are not);
* KV-cache bytes per token and sentence;
* time of one decoding step (one new token attending to ``--decode-context`` cached ones).

Example (the CPU table of docs/benchmarks.md)::

    python scripts/benchmark_attention.py --csv outputs/benchmark_attention_cpu.csv \
        --markdown outputs/benchmark_attention_cpu.md
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from multihead import MultiHeadAttention
from multihead.attention import BackendUnavailableError, available_backends, backend_rules
from multihead.attention.backends import BACKENDS, unavailable_reason
from multihead.timing import interleaved_medians

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class TextbookAttention(nn.Module):
    """The straightforward version: separate Q/K/V linears, explicit softmax, masked_fill."""

    def __init__(self, embed_dim: int, num_heads: int, **factory) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(embed_dim, embed_dim, **factory)
        self.k = nn.Linear(embed_dim, embed_dim, **factory)
        self.v = nn.Linear(embed_dim, embed_dim, **factory)
        self.out = nn.Linear(embed_dim, embed_dim, **factory)

    def forward(self, query: Tensor, memory: Tensor, mask: Tensor | None = None) -> Tensor:
        B, L, E = query.shape
        H, D = self.num_heads, E // self.num_heads
        q = self.q(query).view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
        k = self.k(memory).view(B, -1, H, D).transpose(1, 2)  # (B, H, S, D)
        v = self.v(memory).view(B, -1, H, D).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H, L, S)
        if mask is not None:
            # mask: True = masked out. -inf, as the project's masks use: the usual -1e9
            # does not fit in fp16 (max 65504), and masked_fill refuses it there.
            scores = scores.masked_fill(mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v  # (B, H, L, D)
        return self.out(out.transpose(1, 2).reshape(B, L, E))


# --------------------------------------------------------------------------- candidates
Step = Callable[[], None]


def training_steps(args, B: int, L: int, device, dtype) -> dict[str, Step | str]:
    """name -> a closure running one forward+backward (or a string: why it cannot run)."""
    E, H = args.embed_dim, args.num_heads
    factory = {"device": device, "dtype": dtype}
    x = torch.randn(B, L, E, **factory, requires_grad=True)
    grad = torch.randn(B, L, E, **factory)
    float_causal = nn.Transformer.generate_square_subsequent_mask(L, **factory)
    bool_causal = torch.ones(L, L, dtype=torch.bool, device=device).triu(1)

    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=True, **factory)
    text = TextbookAttention(E, H, **factory)
    steps: dict[str, Step | str] = {
        "nn.MHA (float mask)": lambda: ref(x, x, x, attn_mask=float_causal, need_weights=False)[
            0
        ].backward(grad),
        "nn.MHA (bool mask)": lambda: ref(x, x, x, attn_mask=bool_causal, need_weights=False)[
            0
        ].backward(grad),
        "nn.MHA (float mask + is_causal)": lambda: ref(
            x, x, x, attn_mask=float_causal, need_weights=False, is_causal=True
        )[0].backward(grad),
        "textbook": lambda: text(x, x, bool_causal).backward(grad),
    }
    for backend in args.backends:
        for variant, G in variants(args).items():
            name = f"ours {backend} {variant}"
            why = why_not(backend, device, dtype, training=True)
            if why:
                steps[name] = why
                continue
            layer = MultiHeadAttention(E, H, G, backend=backend, **factory)
            steps[name] = lambda layer=layer: layer(x, is_causal=True).backward(grad)
    return steps


def decode_steps(args, device, dtype) -> dict[str, tuple[Step | str, int | None]]:
    """name -> (one decoding step with ``--decode-context`` cached tokens, cache bytes/token)."""
    E, H, B, T = args.embed_dim, args.num_heads, args.decode_batch, args.decode_context
    factory = {"device": device, "dtype": dtype}
    prefix = torch.randn(B, T, E, **factory)
    new = torch.randn(B, 1, E, **factory)
    context = torch.cat([prefix, new], 1)
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=True, **factory).eval()
    text = TextbookAttention(E, H, **factory).eval()
    # Without a cache, the step projects K/V of the whole context again.
    steps: dict[str, tuple[Step | str, int | None]] = {
        "nn.MHA (no cache)": (lambda: ref(new, context, context, need_weights=False), None),
        "textbook (no cache)": (lambda: text(new, context), None),
    }
    for backend in args.backends:
        for variant, G in variants(args).items():
            name = f"ours {backend} {variant}"
            why = why_not(backend, device, dtype, training=False)
            if why:
                steps[name] = (why, None)
                continue
            layer = MultiHeadAttention(E, H, G, backend=backend, **factory).eval()
            cache = layer.make_kv_cache(B, T + 1)
            with torch.no_grad():
                layer(prefix, is_causal=True, kv_cache=cache)

            def step(layer=layer, cache=cache) -> None:
                layer(new, is_causal=True, kv_cache=cache)
                cache.size = T  # drop the new token again: every repeat decodes position T

            steps[name] = (step, layer.kv_cache_bytes_per_token(dtype))
    return steps


def variants(args) -> dict[str, int]:
    H = args.num_heads
    out = {"mha": H, "gqa": args.gqa_kv_heads, "mqa": 1}
    return {k: v for k, v in out.items() if k in args.variants}


def why_not(backend: str, device: torch.device, dtype: torch.dtype, training: bool) -> str:
    """'' if ``backend`` can run here, else a short reason."""
    reason = unavailable_reason(backend, device, dtype)
    if reason:
        return f"n/a: {reason}"
    if backend == "flex" and training and device.type != "cuda":
        return "n/a: FlexAttention has no backward on CPU"
    return ""


# --------------------------------------------------------------------------- measuring
def peak_bytes(step: Step, device: torch.device) -> int:
    """Peak bytes allocated while ``step`` runs, above what was allocated before."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    live: list[tuple[int, int, int]] = []  # (time, live bytes after it, bytes allocated)

    def walk(nodes) -> None:
        for node in nodes:
            if node.tag == _EventType.Allocation:
                fields = node.extra_fields
                live.append((node.start_time_ns, fields.total_allocated, fields.alloc_size))
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    if not live:
        return 0
    live.sort()
    first = live[0]
    before = first[1] - first[2]  # live bytes just before the first allocation
    return max(b for _, b, _ in live) - before


# --------------------------------------------------------------------------- report
def fmt_ms(seconds: float | str) -> str:
    return seconds if isinstance(seconds, str) else f"{seconds * 1e3:.2f}"


def fmt_ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--embed-dim", type=int, default=512)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--gqa-kv-heads", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=["mha", "gqa", "mqa"])
    parser.add_argument(
        "--shapes", nargs="+", default=["32x32", "8x256", "2x1024"], help="BxL for timing"
    )
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory-len", type=int, default=4096, help="L for peak memory")
    parser.add_argument("--memory-batch", type=int, default=1)
    parser.add_argument("--decode-context", type=int, default=1024)
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--csv", type=Path, default=Path("outputs/benchmark_attention.csv"))
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    rows: list[dict] = []
    lines: list[str] = [
        f"torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + f", {torch.get_num_threads()} threads, dtype {args.dtype}, "
        f"E={args.embed_dim}, H={args.num_heads}, GQA G={args.gqa_kv_heads}, "
        f"available backends: {', '.join(available_backends(device, dtype))}"
        + "".join(f"; {name} declares: {why}" for name, why in backend_rules().items()),
        "",
        "### Forward+backward, causal self-attention (median ms; ratio vs nn.MHA float mask)",
        "",
    ]

    # ---- time
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes]
    header = "| candidate | " + " | ".join(f"B={B} L={L} | ratio" for B, L in shapes) + " |"
    table: dict[str, list[str]] = {}
    for B, L in shapes:
        steps = training_steps(args, B, L, device, dtype)
        runnable = {k: v for k, v in steps.items() if not isinstance(v, str)}
        print(f"timing B={B} L={L}: {len(runnable)} candidates", file=sys.stderr)
        medians = interleaved_medians(runnable, args.repeats, warmup=args.warmup, device=device)
        base = medians["nn.MHA (float mask)"]
        for name, step in steps.items():
            t = step if isinstance(step, str) else medians[name]
            ratio = None if isinstance(step, str) else t / base
            table.setdefault(name, []).extend([fmt_ms(t), fmt_ratio(ratio)])
            rows.append(
                {"figure": "fwd+bwd_ms", "candidate": name, "B": B, "L": L,
                 "value": "" if isinstance(t, str) else round(t * 1e3, 3),
                 "ratio_vs_nn_mha": "" if ratio is None else round(ratio, 4),
                 "note": t if isinstance(t, str) else ""}
            )  # fmt: skip
    lines += [header, "|" + "---|" * (1 + 2 * len(shapes))]
    skipped: dict[str, str] = {}
    for name, cells in table.items():
        if cells[0].startswith("n/a"):
            skipped[name.split()[1]] = cells[0][len("n/a: ") :]
        else:
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Not run here: " + "; ".join(f"{b} ({why})" for b, why in skipped.items())]

    # ---- memory
    B, L = args.memory_batch, args.memory_len
    lines += [
        "",
        f"### Peak memory of one forward+backward at B={B}, L={L} "
        "(MiB; ratio vs the math backend, MHA)",
        "",
        "| candidate | peak MiB | ratio vs math |",
        "|---|---|---|",
    ]
    print(f"memory B={B} L={L}", file=sys.stderr)
    steps = training_steps(args, B, L, device, dtype)
    peaks: dict[str, int | str] = {}
    for name, step in steps.items():
        if isinstance(step, str):
            peaks[name] = step
            continue
        step()  # warm up (lazy allocations, kernel choice)
        try:
            peaks[name] = peak_bytes(step, device)
        except (torch.OutOfMemoryError, RuntimeError) as err:
            peaks[name] = f"failed: {str(err).splitlines()[0][:80]}"
    math_peak = peaks.get("ours math mha")
    for name, peak in peaks.items():
        ratio = peak / math_peak if isinstance(peak, int) and isinstance(math_peak, int) else None
        value = peak if isinstance(peak, str) else f"{peak / 2**20:.1f}"
        if not value.startswith("n/a"):
            lines.append(f"| {name} | {value} | {fmt_ratio(ratio)} |")
        rows.append(
            {"figure": "peak_mib", "candidate": name, "B": B, "L": L,
             "value": "" if isinstance(peak, str) else round(peak / 2**20, 2),
             "ratio_vs_math": "" if ratio is None else round(ratio, 4),
             "note": peak if isinstance(peak, str) else ""}
        )  # fmt: skip

    # ---- decoding
    B, T = args.decode_batch, args.decode_context
    lines += [
        "",
        f"### One decoding step, B={B}, {T} tokens of context "
        "(median ms; ratio vs nn.MHA; KV-cache bytes per token and sentence)",
        "",
        "| candidate | step ms | ratio | cache bytes/token |",
        "|---|---|---|---|",
    ]
    print(f"decoding B={B} T={T}", file=sys.stderr)
    decode = decode_steps(args, device, dtype)
    runnable = {k: v[0] for k, v in decode.items() if not isinstance(v[0], str)}
    with torch.no_grad():
        medians = interleaved_medians(runnable, args.repeats * 3, warmup=args.warmup, device=device)
    base = medians["nn.MHA (no cache)"]
    for name, (step, nbytes) in decode.items():
        t = step if isinstance(step, str) else medians[name]
        ratio = None if isinstance(step, str) else t / base
        cache = "" if nbytes is None else str(nbytes)
        if not isinstance(t, str):
            lines.append(f"| {name} | {fmt_ms(t)} | {fmt_ratio(ratio)} | {cache} |")
        rows.append(
            {"figure": "decode_step_ms", "candidate": name, "B": B, "L": T,
             "value": "" if isinstance(t, str) else round(t * 1e3, 4),
             "ratio_vs_nn_mha": "" if ratio is None else round(ratio, 4),
             "cache_bytes_per_token": cache, "note": t if isinstance(t, str) else ""}
        )  # fmt: skip

    text = "\n".join(lines)
    print(text)
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    fields = ["figure", "candidate", "B", "L", "value", "ratio_vs_nn_mha", "ratio_vs_math",
              "cache_bytes_per_token", "note"]  # fmt: skip
    with args.csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    try:
        main()
    except BackendUnavailableError as err:
        sys.exit(f"benchmark_attention: {err}")
