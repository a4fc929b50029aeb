"""Decoding speed of trained checkpoints, compared in one run.

    python scripts/benchmark_decoding.py CKPT [CKPT ...] --local-dir ../shared/data/multi30k

Translates the test split with greedy search and beam search (KV cache on) for every
checkpoint. Checkpoints are interleaved repeat by repeat, so machine noise hits them alike;
the table gives the median sentences/s and the ratio to the first checkpoint.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from multihead.checkpoints import load_translator
from multihead.data import load_parallel_dataset
from multihead.evaluation import search_settings, translate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--local-dir", default=None, help="raw Multi30k directory")
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, default=None, help="first N sentences only")
    parser.add_argument("--beam-size", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    translators = [load_translator(path) for path in args.checkpoints]
    data_cfg = translators[0].config["data"]
    sources = load_parallel_dataset(
        name=data_cfg["name"],
        src_lang=data_cfg["src_lang"],
        tgt_lang=data_cfg["tgt_lang"],
        local_dir=args.local_dir or data_cfg.get("local_dir"),
    )[args.split]["src"][: args.limit]
    searches = {"greedy": 1, f"beam{args.beam_size}": args.beam_size}
    seconds = {(i, s): [] for i in range(len(translators)) for s in searches}
    for _ in range(args.repeats):
        for i, t in enumerate(translators):
            for name, beam in searches.items():
                start = time.perf_counter()
                with torch.inference_mode():
                    translate(
                        t.model,
                        t.tokenizer,
                        sources,
                        beam_size=beam,
                        batch_size=args.batch_size,
                        **search_settings(t.config),
                    )
                seconds[i, name].append(time.perf_counter() - start)

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {len(sources)} "
        f"{args.split} sentences, batches of {args.batch_size}, median of {args.repeats}"
    )
    header = " | ".join(f"{n} sent/s | {n} ×" for n in searches)
    print(f"| checkpoint | decoder heads | KV-cache bytes/token | {header} |")
    print("|---|---|---|" + "---|---|" * len(searches))
    base = {n: statistics.median(seconds[0, n]) for n in searches}
    for i, (path, t) in enumerate(zip(args.checkpoints, translators, strict=True)):
        heads = t.model.head_config["decoder_self_attention"]
        cells = []
        for name in searches:
            median = statistics.median(seconds[i, name])
            cells.append(f"{len(sources) / median:,.1f} | {base[name] / median:.2f}")
        print(
            f"| {path} | {heads['num_heads']}q/{heads['num_kv_heads']}kv | "
            f"{t.model.kv_cache_bytes_per_token()} | {' | '.join(cells)} |"
        )


if __name__ == "__main__":
    main()
