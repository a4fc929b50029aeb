"""Translation metrics, all computed by sacreBLEU."""

from __future__ import annotations

from dataclasses import dataclass

import sacrebleu
from sacremoses import MosesPunctNormalizer, MosesTokenizer


@dataclass(frozen=True)
class Scores:
    """Corpus scores with sacreBLEU's signatures (so a reader knows how they were made)."""

    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str


def corpus_scores(hypotheses: list[str], references: list[str]) -> Scores:
    """Cased, detokenized sacreBLEU and chrF of ``hypotheses`` against raw ``references``."""
    if len(hypotheses) != len(references):
        raise ValueError(
            f"got {len(hypotheses)} hypotheses for {len(references)} references; "
            "expected one hypothesis per reference"
        )
    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    return Scores(b.score, c.score, str(bleu.get_signature()), str(chrf.get_signature()))


def lc_tok(lines: list[str], lang: str) -> list[str]:
    """Lines as lc-tok BLEU scores them: ``MosesTokenizer(lang).tokenize(
    MosesPunctNormalizer(lang).normalize(line.lower()), escape=True)``. This reproduces the
    Multi30k's own ``.lc.norm.tok`` files."""
    normalizer, tokenizer = MosesPunctNormalizer(lang), MosesTokenizer(lang)
    return [
        tokenizer.tokenize(normalizer.normalize(line.lower()), return_str=True, escape=True)
        for line in lines
    ]


def tokenized_bleu(hypotheses: list[str], references: list[str], lang: str) -> float:
    """BLEU as the Multi30k papers report it: lowercased, Moses-normalized and tokenized.

    Hypotheses and raw references are prepared by :func:`lc_tok` and scored with sacreBLEU
    ``tokenize='none'``.
    """
    refs = lc_tok(references, lang)
    return sacrebleu.corpus_bleu(lc_tok(hypotheses, lang), [refs], tokenize="none").score
