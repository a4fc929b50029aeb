"""sacreBLEU wrappers and the warmup schedules (inverse-sqrt, constant) against hand values."""

from __future__ import annotations

import math

import pytest
import torch

from multihead.evaluation import corpus_scores, tokenized_bleu
from multihead.training import InverseSqrtWarmup


def test_corpus_scores_perfect_and_signature() -> None:
    refs = ["Ein Hund rennt über die Wiese.", "Zwei Männer reden."]
    scores = corpus_scores(refs, refs)
    assert scores.bleu == pytest.approx(100.0) and scores.chrf == pytest.approx(100.0)
    assert scores.bleu_signature.startswith("nrefs:1|case:mixed|eff:no|tok:13a")


def test_corpus_scores_needs_one_hypothesis_per_reference() -> None:
    with pytest.raises(ValueError, match="got 1 hypotheses for 2 references"):
        corpus_scores(["a"], ["a", "b"])


def test_tokenized_bleu_is_case_and_punctuation_insensitive() -> None:
    # Cased, detokenized BLEU sees different tokens; the papers' metric does not.
    hyp, ref = ["EIN HUND RENNT ÜBER DIE WIESE."], ["Ein Hund rennt über die Wiese ."]
    assert corpus_scores(hyp, ref).bleu < 50
    assert tokenized_bleu(hyp, ref, "de") == pytest.approx(100.0)


def test_inverse_sqrt_warmup_values() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = InverseSqrtWarmup(optimizer, warmup_steps=100)
    lrs = []
    for _ in range(400):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lrs[0] == pytest.approx(1 / 100)  # step 0 counts as step 1
    assert lrs[50] == pytest.approx(0.5)
    assert lrs[100] == pytest.approx(1.0)  # the peak, at the end of warmup
    assert lrs[399] == pytest.approx(math.sqrt(100 / 399))
    with pytest.raises(ValueError, match="warmup_steps must be >= 1, got 0"):
        InverseSqrtWarmup(optimizer, warmup_steps=0)
    with pytest.raises(ValueError, match="cooldown_steps must be >= 0, got -1"):
        InverseSqrtWarmup(optimizer, warmup_steps=1, cooldown_steps=-1, total_steps=10)


def test_inverse_sqrt_cooldown_anneals_to_zero_at_total_steps() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = InverseSqrtWarmup(optimizer, warmup_steps=100, cooldown_steps=200, total_steps=500)
    lrs = []
    for _ in range(500):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lrs[100] == pytest.approx(1.0)
    assert lrs[300] == pytest.approx(math.sqrt(100 / 300))  # cooldown starts here
    assert lrs[400] == pytest.approx(math.sqrt(100 / 400) * 0.5)
    assert lrs[499] == pytest.approx(math.sqrt(100 / 499) / 200)
    with pytest.raises(
        ValueError, match="cooldown_steps=200 needs total_steps >= .*got total_steps=250"
    ):
        InverseSqrtWarmup(optimizer, warmup_steps=100, cooldown_steps=200, total_steps=250)


def test_constant_decay_holds_the_peak_until_the_cooldown() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = InverseSqrtWarmup(
        optimizer, warmup_steps=100, decay="constant", cooldown_steps=200, total_steps=500
    )
    lrs = []
    for _ in range(500):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lrs[50] == pytest.approx(0.5)
    assert lrs[100] == lrs[299] == pytest.approx(1.0)  # stable between warmup and cooldown
    assert lrs[400] == pytest.approx(0.5)
    assert lrs[499] == pytest.approx(1 / 200)
    with pytest.raises(ValueError, match="decay='cosine'; expected inverse_sqrt or constant"):
        InverseSqrtWarmup(optimizer, warmup_steps=1, decay="cosine")
