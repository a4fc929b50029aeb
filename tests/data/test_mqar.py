"""MQAR's sequences against its definition (Arora et al. 2023, Zoology's generator): each
query's answer is the value paired with its key earlier in the sequence."""

from __future__ import annotations

import pytest
import torch

from multihead.data.mqar import IGNORE, MQARDataModule, multiquery_ar


@pytest.mark.parametrize("seq_len, pairs", [(64, 4), (256, 16), (256, 64), (512, 128)])
def test_every_query_is_answered_by_the_value_paired_with_its_key(seq_len, pairs):
    V = 8192
    inputs, labels = multiquery_ar(50, seq_len, pairs, V, torch.Generator().manual_seed(3))
    assert inputs.shape == labels.shape == (50, seq_len)
    assert inputs.min() >= 0 and inputs.max() < V
    for x, y in zip(inputs.tolist(), labels.tolist(), strict=True):
        keys, values = x[0 : 2 * pairs : 2], x[1 : 2 * pairs : 2]
        assert all(1 <= k < V // 2 for k in keys) and all(V // 2 <= v < V for v in values)
        assert len(set(keys)) == pairs and len(set(values)) == pairs
        value_of = dict(zip(keys, values, strict=True))
        asked = [t for t, label in enumerate(y) if label != IGNORE]
        assert len(asked) == pairs
        assert all(t >= 2 * pairs and (t - 2 * pairs) % 2 == 0 for t in asked)
        assert sorted(x[t] for t in asked) == sorted(keys)  # each key queried once
        for t in asked:
            assert y[t] == value_of[x[t]]  # the answer: its key's value, seen earlier
        assert all(label == IGNORE for t, label in enumerate(y[: 2 * pairs]))


def test_queries_come_mostly_soon_after_the_pairs():
    # The power law (a = 0.01) puts more queries in the first half of the query region.
    inputs, labels = multiquery_ar(400, 512, 16, 8192, torch.Generator().manual_seed(0))
    t = (labels != IGNORE).nonzero()[:, 1].float()
    region = 512 - 32
    first_half = ((t - 32) < region / 2).float().mean().item()
    assert first_half > 0.55


def test_the_same_seed_gives_the_same_sequences_and_bad_settings_are_refused():
    a = multiquery_ar(4, 128, 8, 1024, torch.Generator().manual_seed(1))
    b = multiquery_ar(4, 128, 8, 1024, torch.Generator().manual_seed(1))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    too_many = "seq_len >= 4 \\* num_kv_pairs, got seq_len=64, num_kv_pairs=32"
    with pytest.raises(ValueError, match=too_many):
        multiquery_ar(1, 64, 32, 8192, torch.Generator())
    with pytest.raises(ValueError, match="vocab_size=100 must exceed seq_len=128"):
        MQARDataModule(train_settings=[[128, 8]], eval_settings=[[128, 8]], vocab_size=100)


def test_the_datamodule_trains_on_its_settings_in_turn_and_holds_the_grid_fixed():
    dm = MQARDataModule(
        train_settings=[[64, 4], [128, 8]], eval_settings=[[64, 4], [128, 16]],
        batch_tokens=1024, eval_examples=70, select_examples=30, seed=5,
    )  # fmt: skip
    dm.setup()
    batches = iter(dm.train_dataloader())
    first, second = next(batches), next(batches)
    assert first["input_ids"].shape == (16, 64) and second["input_ids"].shape == (8, 128)
    # The scored sets, then the selection sets (what a learning rate is chosen on).
    assert dm.val_sets == [
        ("val", "64x4"), ("val", "128x16"), ("select", "64x4"), ("select", "128x16"),
    ]  # fmt: skip
    held = [torch.cat([b["input_ids"] for b in loader]) for loader in dm.val_dataloader()]
    assert [h.shape for h in held] == [(70, 64), (70, 128), (30, 64), (30, 128)]
    # The scored sequences are the ones they have always been (seed 10,000 + the setting's
    # index), whatever the run's seed; the selection ones are other sequences (20,000 + i).
    for i, (seq_len, pairs) in enumerate([(64, 4), (128, 16)]):
        scored, _ = multiquery_ar(
            70, seq_len, pairs, 8192, torch.Generator().manual_seed(10_000 + i)
        )
        chosen, _ = multiquery_ar(
            30, seq_len, pairs, 8192, torch.Generator().manual_seed(20_000 + i)
        )
        assert torch.equal(held[i], scored) and torch.equal(held[2 + i], chosen)
        assert not (held[2 + i][:, None] == held[i][None]).all(-1).any()  # no sequence shared
    other = MQARDataModule(
        train_settings=[[64, 4]], eval_settings=[[64, 4], [128, 16]], eval_examples=70, seed=9
    )
    other.setup()
    assert torch.equal(torch.cat([b["input_ids"] for b in other.val_dataloader()[0]]), held[0])
    with pytest.raises(ValueError, match="data.select_examples must be a positive int, got 0"):
        MQARDataModule(train_settings=[[64, 4]], eval_settings=[[64, 4]], select_examples=0)
