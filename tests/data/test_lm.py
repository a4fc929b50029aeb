"""The LM data: sentences of both languages packed into equal blocks, in a resumable order."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader

from multihead.data.lm import BlockOrder, LanguageModelDataModule, pack_blocks


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


def test_the_block_order_is_torchs_shuffle_and_resumes_at_any_batch() -> None:
    """Three epochs of 10 blocks in batches of 4 (the last of each epoch short): the order of
    torch's own ``DataLoader(shuffle=True)`` seeded the same, and from any position on, the
    batches that follow it in that order."""
    blocks = torch.arange(10)
    reference = DataLoader(
        blocks, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7)
    )
    expected = [b.tolist() for _ in range(3) for b in reference]  # 3 epochs of 3 batches
    used = [0]
    order = BlockOrder(10, 4, seed=7, position=lambda: used[0])
    got = []
    for _ in range(3):  # as the trainer uses them, one epoch per iter
        for batch in order:
            got.append(batch)
            used[0] += 1
    assert got == expected
    for start in (1, 3, 5, 8):  # a resumed run: its epoch's remaining batches, then on
        used[0] = start
        epoch_end = (start // 3 + 1) * 3
        assert list(order) == expected[start:epoch_end]


@pytest.mark.parametrize("state", [{}, {"batches_used": -1}, {"batches_used": "7"}])
def test_a_bad_data_position_in_a_checkpoint_is_refused_by_name(state) -> None:
    with pytest.raises(ValueError, match=r"data position is batches_used=.*expected a count"):
        LanguageModelDataModule().load_state_dict(state)


class _Blocks(LanguageModelDataModule):
    """Ten one-token blocks, no corpus: the block's id is its only token."""

    def setup(self, stage: str | None = None) -> None:
        self.blocks = {"train": torch.arange(10)[:, None], "validation": torch.arange(2)[:, None]}


class _Recorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[:, 0].tolist())
        return self.weight.square()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_each_fit_of_one_datamodule_starts_at_the_first_batch() -> None:
    """A study uptrains several models one after another on one DataModule, each with a new
    trainer and no checkpoint: each sees the first batches of the seeded order (torch's
    ``DataLoader(shuffle=True)``), not the batches after the previous fit's."""
    data = _Blocks(batch_size=4, seed=7)
    reference = DataLoader(
        torch.arange(10), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7)
    )
    expected = [b.tolist() for b in reference][:2]
    for _ in range(2):
        module = _Recorder()
        L.Trainer(
            max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        ).fit(module, datamodule=data)  # fmt: skip
        assert module.seen == expected
