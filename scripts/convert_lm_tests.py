"""The LM conversion study's paired tests: the default conversion against each fixed choice.

python scripts/convert_lm_tests.py OUT_DIR [OUT_DIR ...] [--baseline mla_default]

Each ``OUT_DIR`` is a ``scripts/convert_lm.py`` study (one per ``--seed``). At each ratio,
each fixed method's row against the baseline's, right after conversion and after the
uptraining, paired on the held-out blocks
(:func:`multihead.analysis.conversion_study.paired_block_tests`; Holm over all of them).
Prints a markdown table; positive Δ means the fixed method's perplexity is higher.
"""

import argparse
import json
from pathlib import Path

from multihead.cli import exit_on_user_error

from multihead.analysis.conversion_study import paired_block_tests


@exit_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("studies", type=Path, nargs="+", help="convert_lm.py OUT_DIRs")
    parser.add_argument("--baseline", default="mla_default", help="the method tested against")
    args = parser.parse_args()
    studies = []
    for path in args.studies:
        results = path / "results.json"
        if not results.is_file():
            raise ValueError(f"{path} holds no results.json; expected a convert_lm.py OUT_DIR")
        studies.append(json.loads(results.read_text()))
    tests = paired_block_tests(studies, args.baseline)
    print(f"| ratio | method | step | Δ ppl vs {args.baseline} | per seed | blocks | p | Holm p |")
    print("|---|---|---:|---:|---|---:|---:|---:|")
    for t in tests:
        seeds = " / ".join(f"{d:+.2f}%" for d in t["seed_deltas"])
        print(f"| {t['ratio']} | {t['method']} | {t['step']} | {t['delta_pct']:+.2f}% | {seeds} "
              f"| {t['blocks']} | {t['p']:.2g} | {t['p_holm']:.2g} |")  # fmt: skip


if __name__ == "__main__":
    main()
