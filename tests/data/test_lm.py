"""The LM data: sentences of both languages packed into equal blocks."""

from __future__ import annotations

import pytest
import torch

from multihead.data.lm import LanguageModelDataModule, pack_blocks


def test_sentences_are_wrapped_concatenated_and_cut_into_blocks() -> None:
    blocks = pack_blocks([[5, 6], [7], [8, 9, 10]], bos_id=1, eos_id=2, block_size=4)
    # stream: 1 5 6 2 | 1 7 2 1 | 8 9 10 2 -> three full blocks, nothing left over
    assert blocks.tolist() == [[1, 5, 6, 2], [1, 7, 2, 1], [8, 9, 10, 2]]
    assert pack_blocks([[5, 6], [7]], bos_id=1, eos_id=2, block_size=3).tolist() == [
        [1, 5, 6],
        [2, 1, 7],
    ]  # the last, shorter block ([2]) is dropped
    assert blocks.dtype == torch.long


def test_a_block_longer_than_the_split_is_refused() -> None:
    with pytest.raises(ValueError, match="block_size=9 is longer than the whole split"):
        pack_blocks([[5, 6]], bos_id=1, eos_id=2, block_size=9)


@pytest.mark.parametrize(
    "key, value", [("block_size", 0), ("batch_size", "8"), ("batch_size", True)]
)
def test_bad_sizes_are_refused_in_one_line(key, value) -> None:
    with pytest.raises(ValueError, match=f"{key} must be a positive int, got {value!r}"):
        LanguageModelDataModule(**{key: value})
