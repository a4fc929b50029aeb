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


def logged_figures(module, batches, val_sets=None) -> dict[str, float]:
    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)
    # validation_step reads the held-out sets' names from the trainer's datamodule.
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(val_sets=val_sets))
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
        val_sets=[("val", "12x2"), ("val", "12x1")],
    )
    assert logged["val/acc@12x2"] == 0.5
    assert logged["val/acc@12x1"] == 1.0
    assert logged["val/acc"] == 0.75


def test_the_scored_loss_is_also_split_by_package_and_the_selection_split_kept_apart():
    """Loaders: package a's scored windows, package b's, the selection windows. val/loss is
    the mean over the tokens of a and b; val/loss/a of a's alone; select/ of the third."""
    model = tiny_lm()
    module = LanguageModelModule(model, torch.optim.AdamW, position_buckets=[8])
    a, b, chosen = (torch.randint(1, 50, (n, 16)) for n in (3, 1, 2))
    logged = logged_figures(
        module, [(a, 0), (b, 1), (chosen, 2)],
        val_sets=[("val", "a"), ("val", "b"), ("select", None)],
    )  # fmt: skip
    with torch.no_grad():

        def nll(batch):  # (N, 15): by hand, each token's loss from those before it
            logp = torch.log_softmax(model(batch).double(), dim=-1)[:, :-1]
            return -logp.gather(-1, batch[:, 1:, None]).squeeze(-1)

        losses = {name: nll(batch) for name, batch in (("a", a), ("b", b), ("s", chosen))}
    scored = torch.cat([losses["a"], losses["b"]])
    assert logged["val/loss"] == pytest.approx(scored.mean().item(), rel=1e-5)
    assert logged["val/loss/a"] == pytest.approx(losses["a"].mean().item(), rel=1e-5)
    assert logged["val/loss/b"] == pytest.approx(losses["b"].mean().item(), rel=1e-5)
    assert logged["val/loss@8-15"] == pytest.approx(scored[:, 7:].mean().item(), rel=1e-5)
    assert logged["select/loss"] == pytest.approx(losses["s"].mean().item(), rel=1e-5)
    assert logged["select/ppl"] == pytest.approx(math.exp(losses["s"].mean().item()), rel=1e-5)
    assert not any(k.startswith("select/loss/") for k in logged)


def test_bad_buckets_are_refused_by_name():
    bad = r"position_buckets must be increasing positive ints, got \[64, 8\]"
    with pytest.raises(ValueError, match=bad):
        LanguageModelModule(tiny_lm(), torch.optim.AdamW, position_buckets=[64, 8])
