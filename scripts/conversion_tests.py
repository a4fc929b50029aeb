"""The conversion studies' paired tests: the default conversion against each fixed choice.

python scripts/conversion_tests.py OUT_DIR [OUT_DIR ...] [--baseline mla_default]
python scripts/conversion_tests.py STUDY_DIR [STUDY_DIR ...] --data ../shared/data/multi30k

Each directory is one uptraining seed of one study: a ``scripts/convert_lm.py`` OUT_DIR
(``results.json``; the LM study) or a ``scripts/conversion_study.py`` out= directory
(``rows.jsonl``; the translation study, whose references ``--data`` gives). At each ratio,
each fixed method's row against the baseline's, right after conversion and after the
uptraining; Holm over all of them. The LM's are paired on the held-out blocks
(:func:`multihead.analysis.conversion_study.paired_block_tests`; Δ perplexity, positive =
worse), the translation's on the test sentences
(:func:`multihead.analysis.conversion_study.paired_sentence_tests`; Δ lc-tok BLEU, negative =
worse). A row that is the baseline's model (the same losses or translations in every seed:
the measured choice was that fixed row) is printed as such and is not in the family.
Prints a markdown table.
"""

import argparse
import json
from pathlib import Path

from multihead.cli import exit_on_user_error

from multihead.analysis.conversion_study import paired_block_tests, paired_sentence_tests
from multihead.data import load_parallel_dataset


def kind(path: Path) -> str:
    if (path / "results.json").is_file():
        return "lm"
    if (path / "rows.jsonl").is_file():
        return "translation"
    raise ValueError(
        f"{path} holds neither results.json nor rows.jsonl; expected a convert_lm.py OUT_DIR "
        "or a conversion_study.py out= directory"
    )


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("studies", type=Path, nargs="+", help="one directory per seed")
    parser.add_argument("--baseline", default="mla_default", help="the method tested against")
    parser.add_argument("--data", help="the Multi30k directory (translation studies)")
    parser.add_argument("--pair", default="en-de", help="the study's language pair")
    args = parser.parse_args()
    kinds = {kind(path) for path in args.studies}
    if len(kinds) > 1:
        raise ValueError("the directories mix LM and translation studies; test one study at a time")
    if kinds == {"lm"}:
        studies = [json.loads((path / "results.json").read_text()) for path in args.studies]
        tests = paired_block_tests(studies, args.baseline)
        base = args.baseline
        print(f"| ratio | method | step | Δ ppl vs {base} | per seed | blocks | p | Holm p |")
        print("|---|---|---:|---:|---|---:|---:|---:|")
        for t in tests:
            if t["same"]:
                print(f"| {t['ratio']} | {t['method']} | {t['step']} | 0 (the same model) | "
                      f"| {t['blocks']} | | |")  # fmt: skip
                continue
            seeds = " / ".join(f"{d:+.2f}%" for d in t["seed_deltas"])
            print(f"| {t['ratio']} | {t['method']} | {t['step']} | {t['delta_pct']:+.2f}% "
                  f"| {seeds} | {t['blocks']} | {t['p']:.2g} | {t['p_holm']:.2g} |")  # fmt: skip
        return
    src, _, tgt = args.pair.partition("-")
    if not (src and tgt):
        raise ValueError(f"--pair={args.pair!r}; expected SRC-TGT, e.g. en-de")
    if args.data is None:
        raise ValueError("a translation study needs --data, the Multi30k directory")
    references = load_parallel_dataset("multi30k", src, tgt, local_dir=args.data)["test"]["tgt"]
    tests = paired_sentence_tests(args.studies, list(references), tgt, args.baseline)
    print(f"| ratio | method | step | Δ lc-tok vs {args.baseline} | per seed | 95% interval "
          "| sentences | p | Holm p |")  # fmt: skip
    print("|---|---|---:|---:|---|---|---:|---:|---:|")
    for t in tests:
        if t["same"]:
            print(f"| 1/{t['ratio']} | {t['method']} | {t['step']} | 0 (the same model) | | "
                  f"| {t['sentences']} | | |")  # fmt: skip
            continue
        seeds = " / ".join(f"{d:+.2f}" for d in t["seed_deltas"])
        print(f"| 1/{t['ratio']} | {t['method']} | {t['step']} | {t['delta']:+.2f} | {seeds} "
              f"| {t['low']:+.2f} to {t['high']:+.2f} | {t['sentences']} | {t['p']:.2g} "
              f"| {t['p_holm']:.2g} |")  # fmt: skip


if __name__ == "__main__":
    main()
