from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from multihead.data import (
    TokenBucketSampler,
    batches_by_length,
    collate,
    pack_batches,
    real_token_fraction,
    shard_batch,
)


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
        "global_max_tokens": 300,
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
    # Extra keys (e.g. a "length") are ignored; evaluation examples' rows are kept.
    examples = [
        {"src_ids": [5, 6, 7], "tgt_ids": [8], "src": "a b c", "tgt": "x", "index": 4},
        {"src_ids": [9], "tgt_ids": [10, 11, 12, 13], "src": "d", "tgt": "y z", "index": 1},
    ]
    for ex in examples:
        ex["length"] = 6
    batch = collate(examples, pad_id=0, bos_id=1, eos_id=2)
    assert set(batch) == {"src", "tgt", "src_text", "tgt_text", "real_token_fraction", "index"}
    assert batch["index"] == [4, 1]
    training_example = {k: v for k, v in examples[0].items() if k != "index"}
    assert "index" not in collate([training_example], pad_id=0, bos_id=1, eos_id=2)
    assert torch.equal(batch["src"], torch.tensor([[5, 6, 7, 2], [9, 2, 0, 0]]))
    assert torch.equal(batch["tgt"], torch.tensor([[1, 8, 2, 0, 0, 0], [1, 10, 11, 12, 13, 2]]))
    assert batch["src"].dtype == batch["tgt"].dtype == torch.long
    assert batch["src_text"] == ["a b c", "d"] and batch["tgt_text"] == ["x", "y z"]
    assert batch["real_token_fraction"] == pytest.approx((4 + 2 + 3 + 6) / (8 + 12))
    with pytest.raises(ValueError, match="empty list"):
        collate([], pad_id=0, bos_id=1, eos_id=2)


def test_collate_encodes_the_text_anew_with_encode() -> None:
    examples = [
        {"src_ids": [5, 6, 7], "tgt_ids": [8], "src": "a b c", "tgt": "x"},
        {"src_ids": [9], "tgt_ids": [10, 11], "src": "d", "tgt": "y z"},
    ]

    def encode(texts: list[str]) -> list[list[int]]:  # one id per character: 100 + its code
        return [[100 + ord(c) for c in text] for text in texts]

    batch = collate(examples, pad_id=0, bos_id=1, eos_id=2, encode=encode)
    a, b, c, d, x, y, z, space = (100 + ord(ch) for ch in "abcdxyz ")
    assert batch["src"].tolist() == [[a, space, b, space, c, 2], [d, 2, 0, 0, 0, 0]]
    assert batch["tgt"].tolist() == [[1, x, 2, 0, 0], [1, y, space, z, 2]]
    assert batch["src_text"] == ["a b c", "d"] and batch["tgt_text"] == ["x", "y z"]


def test_shard_batch_written_out() -> None:
    assert [shard_batch([7, 8, 9, 10, 11], rank=r, world_size=2) for r in range(2)] == [
        [7, 8, 9],
        [10, 11],
    ]
    assert [shard_batch([7, 8, 9, 10], rank=r, world_size=3) for r in range(3)] == [
        [7, 8],
        [9],
        [10],
    ]
    # Fewer examples than ranks: every rank still gets one, repeating them.
    assert [shard_batch([7, 8], rank=r, world_size=3) for r in range(3)] == [[7], [8], [7]]


def rank_samplers(lengths: list[int], world_size: int, **kwargs) -> list[TokenBucketSampler]:
    return [
        TokenBucketSampler(lengths, world_size=world_size, rank=rank, **kwargs)
        for rank in range(world_size)
    ]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_split_the_single_process_batches(lengths: list[int], world_size: int) -> None:
    whole = TokenBucketSampler(lengths, max_tokens=100 * world_size, seed=3)
    ranks = rank_samplers(lengths, world_size, max_tokens=100, seed=3)
    epochs = []
    for _ in range(2):  # the shuffle of each epoch is the same on every rank
        expected = list(whole)
        per_rank = [list(sampler) for sampler in ranks]
        assert [len(got) for got in per_rank] == [len(expected)] * world_size
        assert [len(s) for s in ranks] == [len(whole)] * world_size
        repeats = 0
        for step, batch in enumerate(expected):
            shares = [got[step] for got in per_rank]
            if len(batch) >= world_size:
                assert list(itertools.chain(*shares)) == batch  # the union, in rank order
                assert max(map(len, shares)) - min(map(len, shares)) <= 1
            else:  # the longest examples can leave a global batch smaller than world_size
                assert shares == [[batch[r % len(batch)]] for r in range(world_size)]
                repeats += world_size - len(batch)
            for share in shares:
                assert cost(share, lengths) < 100 + max(lengths[i] for i in share)
        flat = list(itertools.chain(*itertools.chain(*per_rank)))
        assert set(flat) == set(range(len(lengths))) and len(flat) == len(lengths) + repeats
        epochs.append(per_rank)
    assert epochs[0] != epochs[1]


def test_small_global_batches_repeat_on_every_rank() -> None:
    # Global budget 2 * 10 = 20: example 2 (length 50) is a global batch of its own.
    ranks = rank_samplers([2, 2, 50], 2, max_tokens=10, shuffle=False)
    assert [list(s) for s in ranks] == [[[2], [0]], [[2], [1]]]


def test_every_rank_resumes_from_rank_0_state(lengths: list[int]) -> None:
    runs = rank_samplers(lengths, 2, max_tokens=100, seed=5)
    iterators = [iter(s) for s in runs]
    seen = [[next(it) for _ in range(6)] for it in iterators]
    states = [s.state_dict() for s in runs]
    assert states[0] == states[1]  # Lightning saves rank 0's and loads it on every rank
    rest = [list(it) for it in iterators]
    after = [list(s) for s in runs]  # then epoch 1

    for rank in range(2):
        resumed = TokenBucketSampler(lengths, max_tokens=100, seed=5, world_size=2, rank=rank)
        resumed.load_state_dict(states[0])
        assert list(resumed) == rest[rank]
        assert list(resumed) == after[rank]
        assert seen[rank] + rest[rank] == runs[rank].epoch_batches(0)


def test_resume_across_world_sizes_with_the_same_global_budget(lengths: list[int]) -> None:
    two = TokenBucketSampler(lengths, max_tokens=100, seed=5, world_size=2, rank=1)
    iterator = iter(two)
    for _ in range(6):
        next(iterator)
    state = two.state_dict()
    one = TokenBucketSampler(lengths, max_tokens=200, seed=5)
    one.load_state_dict(state)
    assert list(one) == one.epoch_batches(0)[6:]
    with pytest.raises(ValueError, match="global_max_tokens=200 but this sampler has"):
        TokenBucketSampler(lengths, max_tokens=100, seed=5).load_state_dict(state)


def test_rank_arguments_are_checked(lengths: list[int]) -> None:
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2"):
        TokenBucketSampler(lengths, max_tokens=64, world_size=2, rank=2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got -1"):
        TokenBucketSampler(lengths, max_tokens=64, world_size=2, rank=-1)
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        TokenBucketSampler(lengths, max_tokens=64, world_size=0)


def test_batches_by_length_sorts_stably_and_cuts_in_order():
    assert list(batches_by_length([3, 1, 2, 1, 5], 2)) == [[1, 3], [2, 0], [4]]
    assert list(batches_by_length([], 4)) == []
