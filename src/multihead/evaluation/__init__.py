"""Translating and scoring: sentences in, translations and sacreBLEU scores out.

Used during training (validation BLEU) and after it (``scripts/evaluate.py``,
``scripts/translate.py``, learning curves).
"""

from multihead.evaluation.metrics import Scores, corpus_scores, tokenized_bleu
from multihead.evaluation.scoring import evaluate_checkpoint
from multihead.evaluation.translate import translate

__all__ = [
    "Scores",
    "corpus_scores",
    "evaluate_checkpoint",
    "tokenized_bleu",
    "translate",
]
