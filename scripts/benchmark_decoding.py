"""Decoding speed of trained checkpoints, ours against CTranslate2, compared in one run.

    python scripts/benchmark_decoding.py CKPT [CKPT ...] --local-dir ../shared/data/multi30k
    python scripts/benchmark_decoding.py CKPT --ctranslate2 --threads 2   # + CT2 fp32, int8
    python scripts/benchmark_decoding.py CKPT --engines ct2-fp32 --threads 2   # one engine
    python scripts/benchmark_decoding.py MLA_CKPT --engines ours ours-expanded   # absorption

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
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import multihead.cli  # noqa: F401  (names the train extra when it is missing)

import torch

from multihead.attention.latent import LatentKV
from multihead.checkpoints import load_trained_model, search_settings
from multihead.data import load_parallel_dataset
from multihead.evaluation import corpus_scores, translate

ENGINES = ("ours", "ours expanded", "ct2 fp32", "ct2 int8")


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
    args = parser.parse_args()

    names = ENGINES if args.ctranslate2 else ENGINES[:2]
    if args.engines:
        names = tuple(name.replace("-", " ") for name in args.engines)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    translators = [load_trained_model(path) for path in args.checkpoints]
    data_cfg = translators[0].config["data"]
    split = load_parallel_dataset(
        name=data_cfg["name"],
        src_lang=data_cfg["src_lang"],
        tgt_lang=data_cfg["tgt_lang"],
        local_dir=args.local_dir or data_cfg.get("local_dir"),
    )[args.split]
    sources, references = split["src"][: args.limit], split["tgt"][: args.limit]
    searches = {"greedy": 1, f"beam{args.beam_size}": args.beam_size}

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

    seconds = {(key, s): [] for key in engines for s in searches}
    outputs = {}
    for _ in range(args.repeats):
        for key, run in engines.items():
            for name, beam in searches.items():
                start = time.perf_counter()
                with torch.inference_mode():
                    outputs[key, name] = run(sources, beam)
                seconds[key, name].append(time.perf_counter() - start)
    tmp.cleanup()

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


if __name__ == "__main__":
    main()
