from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from multihead.data import TokenBucketSampler, collate, pack_batches, real_token_fraction


@pytest.fixture
def lengths() -> list[int]:
    rng = np.random.default_rng(0)
    return rng.integers(3, 40, size=1000).tolist()


def cost(batch: list[int], lengths: list[int]) -> int:
    return len(batch) * max(lengths[i] for i in batch)


def test_respects_max_tokens_and_covers_once(lengths: list[int]) -> None:
    sampler = TokenBucketSampler(lengths, max_tokens=300, seed=1)
    for _ in range(3):
        batches = list(sampler)
        assert len(batches) == len(sampler)
        assert all(cost(b, lengths) <= 300 for b in batches)
        assert sorted(itertools.chain(*batches)) == list(range(len(lengths)))


def test_low_padding(lengths: list[int]) -> None:
    sampler = TokenBucketSampler(lengths, max_tokens=300)
    assert real_token_fraction(sampler.epoch_batches(0), lengths, lengths) > 0.95
    assert sampler.epoch_batches(0) == list(sampler)


def test_real_token_fraction_matches_collate() -> None:
    examples = [
        {"src_ids": [5] * n, "tgt_ids": [6] * m, "src": "", "tgt": ""}
        for n, m in [(3, 1), (1, 4), (2, 2)]
    ]
    batch = collate(examples, pad_id=0, bos_id=1, eos_id=2)
    src_lengths, tgt_lengths = [4, 2, 3], [3, 6, 4]
    fraction = real_token_fraction([[0, 1, 2]], src_lengths, tgt_lengths)
    assert fraction == pytest.approx(batch["real_token_fraction"])


def test_deterministic_and_epochs_differ(lengths: list[int]) -> None:
    a = TokenBucketSampler(lengths, max_tokens=300, seed=3)
    b = TokenBucketSampler(lengths, max_tokens=300, seed=3)
    assert list(a) == list(b)
    assert list(a) == list(b)  # epoch 1 for both
    assert a.epoch == 1
    b.set_epoch(0)
    assert list(b) != list(a)
    other_seed = TokenBucketSampler(lengths, max_tokens=300, seed=4)
    assert list(other_seed) != list(TokenBucketSampler(lengths, max_tokens=300, seed=3))


def test_resume_yields_exactly_the_rest(lengths: list[int]) -> None:
    sampler = TokenBucketSampler(lengths, max_tokens=300, seed=5)
    list(sampler)  # epoch 0
    iterator = iter(sampler)  # epoch 1
    seen = [next(iterator) for _ in range(7)]
    state = sampler.state_dict()
    assert state["epoch"] == 1 and state["batches_yielded"] == 7
    rest = list(iterator)

    resumed = TokenBucketSampler(lengths, max_tokens=300, seed=5)
    resumed.load_state_dict(state)
    assert list(resumed) == rest
    reference = TokenBucketSampler(lengths, max_tokens=300, seed=5)
    reference.set_epoch(2)
    assert list(resumed) == list(reference)  # then the next epoch, from its start
    fresh = TokenBucketSampler(lengths, max_tokens=300, seed=5)
    fresh.set_epoch(1)
    assert seen + rest == list(fresh)


def test_resume_with_consumed_count_and_epoch_end(lengths: list[int]) -> None:
    sampler = TokenBucketSampler(lengths, max_tokens=300, seed=5)
    iterator = iter(sampler)
    batches = [next(iterator) for _ in range(5)]  # 5 fetched, 3 really used
    state = sampler.state_dict(batches_consumed=3)
    resumed = TokenBucketSampler(lengths, max_tokens=300, seed=5)
    resumed.load_state_dict(state)
    assert next(iter(resumed)) == batches[3]

    full = list(TokenBucketSampler(lengths, max_tokens=300, seed=5))
    finished = TokenBucketSampler(lengths, max_tokens=300, seed=5)
    list(finished)
    assert finished.state_dict() == {
        "epoch": 1,
        "batches_yielded": 0,
        "seed": 5,
        "num_examples": 1000,
    }
    resumed.load_state_dict(finished.state_dict())
    assert list(resumed) != full and len(list(resumed)) == len(full)


def test_set_epoch_keeps_loaded_position(lengths: list[int]) -> None:
    sampler = TokenBucketSampler(lengths, max_tokens=300, seed=5)
    sampler.load_state_dict({"epoch": 2, "batches_yielded": 4})
    sampler.set_epoch(2)  # a trainer announcing the resumed epoch
    assert len(list(sampler)) == len(sampler) - 4


def test_state_errors(lengths: list[int]) -> None:
    sampler = TokenBucketSampler(lengths, max_tokens=300, seed=5)
    with pytest.raises(ValueError, match="seed=6 but this sampler has seed=5"):
        sampler.load_state_dict({"epoch": 0, "batches_yielded": 0, "seed": 6})
    with pytest.raises(ValueError, match="batches_yielded=100000 is outside"):
        sampler.load_state_dict({"epoch": 0, "batches_yielded": 100000})
    with pytest.raises(ValueError, match="max_tokens must be a positive integer, got 0"):
        TokenBucketSampler(lengths, max_tokens=0)


def test_eval_order_sorted_and_fixed(lengths: list[int]) -> None:
    sampler = TokenBucketSampler(lengths, max_tokens=300, shuffle=False)
    first, second = list(sampler), list(sampler)
    assert first == second
    flat = list(itertools.chain(*first))
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)
    assert sorted(flat) == list(range(len(lengths)))


def test_overlong_example_is_alone() -> None:
    assert pack_batches([0, 1, 2], np.array([2, 50, 2]), max_tokens=10) == [[0], [1], [2]]
    assert pack_batches([0, 2, 1], np.array([2, 50, 2]), max_tokens=10) == [[0, 2], [1]]


def test_collate() -> None:
    # Extra keys (callers may pass an "index" or a "length") are ignored.
    examples = [
        {"src_ids": [5, 6, 7], "tgt_ids": [8], "src": "a b c", "tgt": "x", "index": 4},
        {"src_ids": [9], "tgt_ids": [10, 11, 12, 13], "src": "d", "tgt": "y z", "length": 6},
    ]
    batch = collate(examples, pad_id=0, bos_id=1, eos_id=2)
    assert set(batch) == {"src", "tgt", "src_text", "tgt_text", "real_token_fraction"}
    assert torch.equal(batch["src"], torch.tensor([[5, 6, 7, 2], [9, 2, 0, 0]]))
    assert torch.equal(batch["tgt"], torch.tensor([[1, 8, 2, 0, 0, 0], [1, 10, 11, 12, 13, 2]]))
    assert batch["src"].dtype == batch["tgt"].dtype == torch.long
    assert batch["src_text"] == ["a b c", "d"] and batch["tgt_text"] == ["x", "y z"]
    assert batch["real_token_fraction"] == pytest.approx((4 + 2 + 3 + 6) / (8 + 12))
    with pytest.raises(ValueError, match="empty list"):
        collate([], pad_id=0, bos_id=1, eos_id=2)


def test_ranks_share_out_the_same_batches() -> None:
    lengths = [5 + (i * 7) % 23 for i in range(300)]
    whole = TokenBucketSampler(lengths, max_tokens=64, seed=3)
    shards = [
        TokenBucketSampler(lengths, max_tokens=64, seed=3, num_replicas=3, rank=r) for r in range(3)
    ]
    batches = list(whole)
    per_rank = [list(s) for s in shards]
    assert all(len(b) == len(batches) // 3 == len(s) for b, s in zip(per_rank, shards, strict=True))
    for rank, got in enumerate(per_rank):
        assert got == batches[rank::3][: len(batches) // 3]
    with pytest.raises(ValueError, match="rank must be in"):
        TokenBucketSampler(lengths, max_tokens=64, num_replicas=2, rank=2)
