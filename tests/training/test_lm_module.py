"""The causal-LM module's held-out figures against a hand computation: the loss by position
bucket (position = tokens of context before the predicted token) and MQAR's accuracy."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from multihead.model.lm import DecoderLM
from multihead.training.lm import LanguageModelModule


def tiny_lm() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(
        vocab_size=50, d_model=32, ffn_dim=64, num_layers=1, max_positions=64,
        attention={"num_heads": 4},
    ).eval()  # fmt: skip


def logged_figures(module, batches, val_names=None) -> dict[str, float]:
    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)
    # validation_step reads the held-out sets' names from the trainer's datamodule.
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(val_names=val_names))
    with torch.no_grad():
        for i, (batch, idx) in enumerate(batches):
            module.validation_step(batch, i, idx)
    module.on_validation_epoch_end()
    return logged


def test_the_loss_by_position_bucket_is_the_mean_of_its_tokens_losses():
    model = tiny_lm()
    module = LanguageModelModule(model, torch.optim.AdamW, position_buckets=[4, 10])
    batches = [torch.randint(1, 50, (2, 16)), torch.randint(1, 50, (3, 16))]
    logged = logged_figures(module, [(b, 0) for b in batches])
    # By hand: the token at position t (t >= 1) is predicted from positions 0 .. t-1.
    by_position: dict[int, list[float]] = {}
    with torch.no_grad():
        for batch in batches:
            logp = torch.log_softmax(model(batch).double(), dim=-1)
            for row in range(batch.shape[0]):
                for t in range(1, 16):
                    nll = -logp[row, t - 1, batch[row, t]].item()
                    by_position.setdefault(t, []).append(nll)
    mean = lambda ts: sum(sum(by_position[t]) for t in ts) / sum(len(by_position[t]) for t in ts)  # noqa: E731
    assert logged["val/loss@0-3"] == pytest.approx(mean(range(1, 4)), rel=1e-5)
    assert logged["val/loss@4-9"] == pytest.approx(mean(range(4, 10)), rel=1e-5)
    assert logged["val/loss@10-15"] == pytest.approx(mean(range(10, 16)), rel=1e-5)
    assert logged["val/loss"] == pytest.approx(mean(range(1, 16)), rel=1e-5)
    assert logged["val/ppl"] == pytest.approx(math.exp(mean(range(1, 16))), rel=1e-5)


def test_recall_accuracy_counts_the_labelled_positions_alone():
    model = tiny_lm()
    module = LanguageModelModule(model, torch.optim.AdamW)
    ids = torch.randint(1, 50, (4, 12))
    with torch.no_grad():
        guess = model(ids).argmax(-1)  # (4, 12)
    labels = torch.full((4, 12), -100)
    labels[0, 3], labels[1, 5], labels[2, 7], labels[3, 9] = guess[0, 3], guess[1, 5], 0, 0
    labels[2, 7] = (guess[2, 7] + 1) % 50  # wrong
    labels[3, 9] = (guess[3, 9] + 1) % 50  # wrong
    other = torch.full((4, 12), -100)
    other[:, 2] = guess[:, 2]  # all right
    logged = logged_figures(
        module,
        [({"input_ids": ids, "labels": labels}, 0), ({"input_ids": ids, "labels": other}, 1)],
        val_names=["12x2", "12x1"],
    )
    assert logged["val/acc@12x2"] == 0.5
    assert logged["val/acc@12x1"] == 1.0
    assert logged["val/acc"] == 0.75


def test_bad_buckets_are_refused_by_name():
    bad = r"position_buckets must be increasing positive ints, got \[64, 8\]"
    with pytest.raises(ValueError, match=bad):
        LanguageModelModule(tiny_lm(), torch.optim.AdamW, position_buckets=[64, 8])
