"""Decoding speed of trained checkpoints, ours against CTranslate2, compared in one run.

    python scripts/benchmark_decoding.py CKPT [CKPT ...] --local-dir ../shared/data/multi30k
    python scripts/benchmark_decoding.py CKPT --ctranslate2 --threads 2   # + CT2 fp32, int8
    python scripts/benchmark_decoding.py CKPT --engines ct2-fp32 --threads 2   # one engine
    python scripts/benchmark_decoding.py MLA_CKPT --engines ours ours-expanded   # absorption
    python scripts/benchmark_decoding.py CKPT --alternate 2 --engines ours ct2-fp32 --threads 2
    python scripts/benchmark_decoding.py CKPT --profile --limit 256 --threads 2  # where time goes

Translates the test split with greedy search and beam search (KV cache on) for every
checkpoint and engine, on the same sentences, threads, beam size, length penalty and batches
(sorted by length). With ``--ctranslate2`` each checkpoint is exported to a temporary
CTranslate2 model and also decoded by CTranslate2 in float32 and int8. Runs are interleaved
repeat by repeat, so machine noise hits them alike; the table gives the median sentences/s,
the ratio to our decoder on the same checkpoint (or, without CT2, to the first checkpoint),
output words per second (fairer than sentences/s between models whose outputs differ in
length), cased BLEU, and for CT2 the share of outputs identical to ours. ``ours expanded``
decodes an MLA checkpoint with its K/V re-expanded from the cached latent at every step
instead of absorbed (what absorption buys); it is skipped for checkpoints without MLA.

``--alternate N`` is the fair protocol between engines: each engine runs in a process of its
own (two OpenMP runtimes in one process slow each other), the processes alternate for ``N``
rounds, and each round's row gives the ratio to our decoder in that round and how many
outputs equal ours. Every table starts with the host's CPU: decode speed depends on it (and
CTranslate2 picks its GEMM library by CPU vendor).

``--profile`` times our decoder once under ``torch.profiler`` instead and prints where a
search spends its time, op by op, grouped by what a decoding step does.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import multihead.cli  # noqa: F401  (names the train extra when it is missing)

import torch

from multihead.attention.latent import LatentKV
from multihead.checkpoints import load_trained_model, search_settings
from multihead.data import load_parallel_dataset
from multihead.evaluation import corpus_scores, translate
from multihead.host import cpu_info, cpu_model
from multihead.timing import interleaved_seconds

ENGINES = ("ours", "ours expanded", "ct2 fp32", "ct2 int8")


def host_report() -> str:
    """The CPU the figures come from, the vector ISA torch's kernels use, and the GEMM
    library CTranslate2 picks (src/cpu/backend.cc: Intel MKL on GenuineIntel CPUs, oneDNN on
    others, unless ``CT2_USE_MKL`` says otherwise)."""
    info = cpu_info()
    name = cpu_model()
    vendor = info.get("vendor_id", "unknown vendor")
    flags = set(info.get("flags", "").split())
    avx512 = sorted(f for f in flags if f.startswith("avx512"))
    use_mkl = os.environ.get("CT2_USE_MKL", "")
    mkl = use_mkl.lower() in ("1", "true", "on") if use_mkl else vendor == "GenuineIntel"
    has_avx512 = f"yes ({' '.join(avx512)})" if avx512 else "no"
    return (
        f"cpu: {name} ({vendor}, {os.cpu_count()} logical cores), AVX2 "
        f"{'yes' if 'avx2' in flags else 'no'}, AVX-512 {has_avx512}; "
        f"torch kernels: {torch.backends.cpu.get_cpu_capability()}; "
        f"CTranslate2 fp32 GEMM: {'Intel MKL' if mkl else 'oneDNN'}"
    )


# What a decoding step does, by the ops that do it (self time; the rest is "other ops").
STEP_PARTS = {
    "output projection (E -> V)": ("mkldnn::_linear_pointwise", "aten::mm"),
    "other projections (Q/K/V, out, FFN)": ("aten::addmm",),
    "attention over the cache": (
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_attention_math",
        "aten::bmm",
        "aten::_softmax",
    ),
    "cache writes, beam reorder, layout copies": (
        "aten::index_select",
        "aten::copy_",
        "aten::index",
        "aten::index_put_",
        "aten::cat",
    ),
    "log-softmax, scores, top-k": (
        "aten::_log_softmax",
        "aten::topk",
        "aten::amax",
        "aten::max",
        "aten::gather",
        "aten::add_",
        "aten::masked_fill_",
    ),
    "layer norm, residuals, activation": (
        "aten::native_layer_norm",
        "aten::add",
        "aten::clamp_min",
    ),
}


def profile_searches(translate_fn, sources, searches) -> None:
    """Print, per search, the share of wall time in each part of a step (STEP_PARTS)."""
    from torch.profiler import ProfilerActivity, profile

    for name, beam in searches.items():
        translate_fn(sources[:32], beam)  # warm up
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            translate_fn(sources, beam)
        wall = time.perf_counter() - start
        self_us = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
        print(f"\n{name}: {len(sources)} sentences, {wall:.2f} s under the profiler")
        print("| part of a step | ops | ms | share of wall time |\n|---|---|---:|---:|")
        total = 0.0
        for part, ops in STEP_PARTS.items():
            seconds = sum(self_us.get(op, 0.0) for op in ops) / 1e6
            total += seconds
            names = ", ".join(o.split("::")[1] for o in ops)
            print(f"| {part} | {names} | {seconds * 1e3:.2f} | {seconds / wall:.1%} |")
        ops_total = sum(self_us.values()) / 1e6
        other, outside = ops_total - total, wall - ops_total
        print(f"| other ops | | {other * 1e3:.2f} | {other / wall:.1%} |")
        outside_name = "outside ops (Python, dispatch, profiler)"
        print(f"| {outside_name} | | {outside * 1e3:.2f} | {outside / wall:.1%} |")


def alternate(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """Each engine in its own process, alternating for ``args.alternate`` rounds.

    With ``--against TREE`` our decoder also runs from another source tree (``TREE/src``, e.g.
    a ``git worktree`` of the commit before a change), labelled ``ours TREE``.
    """
    common = [*args.checkpoints, "--split", args.split, "--beam-size", str(args.beam_size)]
    common += ["--length-penalty", str(args.length_penalty), "--batch-size", str(args.batch_size)]
    common += ["--repeats", str(args.repeats)]
    options = {"--local-dir": args.local_dir, "--limit": args.limit, "--backend": args.backend}
    for option, value in options.items():
        if value is not None:
            common += [option, str(value)]
    if args.threads is not None:
        common += ["--threads", str(args.threads)]
    jobs = [(name, name, None) for name in names]  # (label, engine, PYTHONPATH)
    if args.against:
        jobs.append((f"ours {args.against}", "ours", str(Path(args.against, "src").resolve())))
    runs = {}  # (round, label) -> the child's JSON
    with tempfile.TemporaryDirectory(prefix="benchmark_decoding.") as tmp:
        for r in range(args.alternate):
            for label, engine, pythonpath in jobs:
                out = Path(tmp) / f"{r}_{len(runs)}.json"
                env = dict(os.environ)
                if pythonpath:
                    env["PYTHONPATH"] = os.pathsep.join([pythonpath, env.get("PYTHONPATH", "")])
                cmd = [sys.executable, __file__, *common, "--engines", engine.replace(" ", "-")]
                child = subprocess.run(
                    [*cmd, "--json", str(out)], env=env, stdout=subprocess.DEVNULL
                )
                if child.returncode != 0:  # its own error is printed above
                    sys.exit(
                        f"error: engine {label!r} failed in round {r + 1} (exit {child.returncode})"
                    )
                runs[r, label] = json.loads(out.read_text())
    first = runs[0, jobs[0][0]]
    print(host_report())
    print(
        f"torch {torch.__version__}, {first['threads']} threads, {first['sentences']} "
        f"{args.split} sentences, batches of {args.batch_size} sorted by length, length "
        f"penalty {args.length_penalty}, median of {args.repeats} per process, engines "
        f"alternating in processes of their own, {args.alternate} rounds"
    )
    searches = first["searches"]
    cols = " | ".join(f"{n} sent/s | {n} × ours | {n} BLEU | {n} same as ours" for n in searches)
    print(f"| checkpoint | round | engine | {cols} |")
    print("|---|---|---|" + "---|---|---|---|" * len(searches))
    for i, ckpt in enumerate(args.checkpoints):
        for r in range(args.alternate):
            ours = runs[r, "ours"]["results"].get(str(i)) if "ours" in names else None
            for label, *_ in jobs:
                results = runs[r, label]["results"].get(str(i))
                if results is None:  # "ours expanded" on a checkpoint without MLA
                    continue
                cells = []
                for search in searches:
                    seconds = statistics.median(results[search]["seconds"])
                    ratio = same = "n/a"
                    if ours is not None:
                        ratio = f"{statistics.median(ours[search]['seconds']) / seconds:.2f}"
                        pairs = zip(
                            results[search]["outputs"], ours[search]["outputs"], strict=True
                        )
                        same = f"{sum(a == b for a, b in pairs)}/{first['sentences']}"
                    cells.append(
                        f"{first['sentences'] / seconds:,.1f} | {ratio} | "
                        f"{results[search]['bleu']:.2f} | {same}"
                    )
                print(f"| {ckpt} | {r + 1} | {label} | {' | '.join(cells)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--local-dir", default=None, help="raw Multi30k directory")
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, default=None, help="first N sentences only")
    parser.add_argument("--beam-size", type=int, default=5)
    parser.add_argument("--length-penalty", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's choice")
    parser.add_argument("--ctranslate2", action="store_true", help="also time CTranslate2")
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=[name.replace(" ", "-") for name in ENGINES],
        default=None,
        help="time only these (default: ours, plus both CT2 types with --ctranslate2); one "
        "engine per process avoids the two OpenMP runtimes slowing each other",
    )
    parser.add_argument(
        "--alternate",
        type=int,
        default=0,
        metavar="N",
        help="run each engine in its own process, alternating, for N rounds",
    )
    parser.add_argument(
        "--backend",
        default=None,
        help="run our decoder's attention with this backend instead of the trained one",
    )
    parser.add_argument(
        "--against",
        default=None,
        metavar="TREE",
        help="with --alternate: also time our decoder from TREE/src (a worktree of another commit)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="profile our decoder instead of timing engines"
    )
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)  # --alternate's children
    args = parser.parse_args()

    names = ENGINES if args.ctranslate2 else ENGINES[:2]
    if args.engines:
        names = tuple(name.replace("-", " ") for name in args.engines)
    if args.alternate < 0:
        parser.error(f"--alternate must be >= 1 rounds, got {args.alternate}")
    if args.against is not None:
        if not args.alternate:
            parser.error("--against needs --alternate N")
        if not (Path(args.against) / "src" / "multihead").is_dir():
            parser.error(f"--against {args.against}: expected a source tree with src/multihead")
    if args.alternate:
        return alternate(args, names)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    translators = [load_trained_model(path, backend=args.backend) for path in args.checkpoints]
    data_cfg = translators[0].config["data"]
    split = load_parallel_dataset(
        name=data_cfg["name"],
        src_lang=data_cfg["src_lang"],
        tgt_lang=data_cfg["tgt_lang"],
        local_dir=args.local_dir or data_cfg.get("local_dir"),
    )[args.split]
    sources, references = split["src"][: args.limit], split["tgt"][: args.limit]
    searches = {"greedy": 1, f"beam{args.beam_size}": args.beam_size}
    if args.profile:
        t = translators[0]
        settings = search_settings(t.config, length_penalty=args.length_penalty)
        options = dict(batch_size=args.batch_size, **settings)
        print(host_report())
        print(f"torch {torch.__version__}, {threads} threads, {args.checkpoints[0]}")
        with torch.inference_mode():
            profile_searches(
                lambda s, beam: translate(t.model, t.tokenizer, s, beam_size=beam, **options),
                sources,
                searches,
            )
        return

    # engines[(checkpoint index, engine name)] = function(sentences, beam) -> outputs
    engines = {}
    tmp = tempfile.TemporaryDirectory(prefix="benchmark_decoding.")
    for i, t in enumerate(translators):
        # The checkpoint's own length limits; the length penalty as given, for both engines.
        options = dict(
            batch_size=args.batch_size,
            **search_settings(t.config, length_penalty=args.length_penalty),
        )
        if "ours" in names:
            engines[i, "ours"] = lambda s, beam, t=t, o=options: translate(
                t.model, t.tokenizer, s, beam_size=beam, **o
            )
        latents = [
            a.design for *_, a in t.model.attention_sublayers() if isinstance(a.design, LatentKV)
        ]
        if "ours expanded" in names and latents:

            def expanded(s, beam, t=t, o=options, latents=latents):
                for latent in latents:
                    latent.absorb = False
                try:
                    return translate(t.model, t.tokenizer, s, beam_size=beam, **o)
                finally:
                    for latent in latents:
                        latent.absorb = True

            engines[i, "ours expanded"] = expanded
        if any(name.startswith("ct2") for name in names):
            from multihead.deploy.engine import CTranslate2Engine
            from multihead.deploy.export import export_ctranslate2

            out = export_ctranslate2(ckpt=args.checkpoints[i], out=Path(tmp.name) / f"ct2_{i}")
            for name, compute_type in (("ct2 fp32", "float32"), ("ct2 int8", "int8")):
                if name not in names:
                    continue
                engine = CTranslate2Engine(out, compute_type=compute_type, threads=threads)
                engines[i, name] = lambda s, beam, e=engine, o=options: e.translate(
                    s, beam_size=beam, **o
                )

    outputs = {}  # (engine key, search) -> the last round's translations

    def search(key, name: str, beam: int) -> None:
        with torch.inference_mode():
            outputs[key, name] = engines[key](sources, beam)

    jobs = {
        (key, name): functools.partial(search, key, name, beam)
        for key in engines
        for name, beam in searches.items()
    }
    seconds = interleaved_seconds(jobs, args.repeats, warmup=0)
    tmp.cleanup()

    if args.json:
        results = {
            str(i): {
                name: {
                    "seconds": seconds[(i, engine), name],
                    "outputs": outputs[(i, engine), name],
                    "bleu": corpus_scores(outputs[(i, engine), name], references).bleu,
                }
                for name in searches
            }
            for (i, engine) in engines
        }
        summary = {"threads": threads, "sentences": len(sources), "searches": list(searches)}
        Path(args.json).write_text(json.dumps({**summary, "results": results}))
        return
    print(host_report())
    print(
        f"torch {torch.__version__}, {threads} threads, {len(sources)} {args.split} sentences, "
        f"batches of {args.batch_size} sorted by length, length penalty {args.length_penalty}, "
        f"median of {args.repeats}"
    )
    cols = " | ".join(
        f"{n} sent/s | {n} × | {n} words/s | {n} BLEU | {n} same as ours" for n in searches
    )
    print(f"| checkpoint | engine | decoder heads | KV-cache bytes/token | {cols} |")
    print("|---|---|---|---|" + "---|---|---|---|---|" * len(searches))
    for (i, engine), _ in engines.items():
        model = translators[i].model
        heads = model.head_config["decoder_self_attention"]
        cache = model.kv_cache_bytes_per_token()
        if engine.startswith("ct2"):
            # CTranslate2 4.8 repeats GQA/MQA K/V heads to all query heads before caching
            # (layers/attention.cc), and runs MLA as its MHA equivalent: H heads of K and V.
            cache = len(model.decoder_layers) * 2 * model.d_model * 4
        base_key = (i, "ours") if len(names) > 1 else (0, names[0])
        cells = []
        for name in searches:
            median = statistics.median(seconds[(i, engine), name])
            bleu = corpus_scores(outputs[(i, engine), name], references).bleu
            words = sum(len(h.split()) for h in outputs[(i, engine), name])
            ratio = same = "n/a"  # without our decoder in this process there is nothing to compare
            if base_key in engines:
                ratio = f"{statistics.median(seconds[base_key, name]) / median:.2f}"
            if (i, "ours") in engines:
                ours = outputs[(i, "ours"), name]
                hits = sum(a == b for a, b in zip(outputs[(i, engine), name], ours, strict=True))
                same = f"{hits}/{len(sources)}"
            cells.append(
                f"{len(sources) / median:,.1f} | {ratio} | {words / median:,.0f} | "
                f"{bleu:.2f} | {same}"
            )
        print(
            f"| {args.checkpoints[i]} | {engine} | {heads['num_heads']}q/{heads['num_kv_heads']}kv "
            f"| {cache} | {' | '.join(cells)} |"
        )
    for i, translator in enumerate(translators):  # a backend's declared reroute, once each
        for kind, heads in translator.model.head_config.items():
            if "backend_reroute" in heads:
                print(
                    f"{args.checkpoints[i]} {kind}: {heads['backend']}: {heads['backend_reroute']}"
                )


if __name__ == "__main__":
    main()
