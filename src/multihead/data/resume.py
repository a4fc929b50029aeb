"""Resuming a training whose batches follow from a seed and their index.

The language models' data (:mod:`multihead.data.lm`) and MQAR's (:mod:`multihead.data.mqar`)
draw batch ``i`` of a run the same way every time, so the position to resume from is one
number: the training batches already used. (Translation's length-bucketing sampler keeps a
richer state of its own, :meth:`~multihead.data.batching.TokenBucketSampler.state_dict`.)
"""

from __future__ import annotations

from typing import Any


class CountsTrainingBatches:
    """A mixin for a ``LightningDataModule``: ``batches_used`` counts the training batches the
    trainer really used, and the training data starts at that batch.

    The count goes into ``state_dict``, which Lightning stores in every checkpoint and gives
    back to ``load_state_dict`` on resuming; without it, a resumed run would start its data
    again from the first batch and train on the batches before the checkpoint twice.
    Batches are counted in ``on_before_batch_transfer``, when the trainer takes them for a
    step, not when the loader yields them: Lightning fetches one batch ahead.

    The count belongs to one fit: when it ends (``teardown``), the next fit of the same
    DataModule starts again from the first batch unless its checkpoint gives a position, so
    rows of a study that uptrain one after another on one DataModule see the same batches.
    """

    batches_used: int = 0

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        trainer = self.trainer
        if trainer is not None and trainer.training:
            self.batches_used += 1
        return batch

    def teardown(self, stage: str) -> None:
        if stage == "fit":
            self.batches_used = 0

    def state_dict(self) -> dict[str, int]:
        return {"batches_used": self.batches_used}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        used = state_dict.get("batches_used")
        if not isinstance(used, int) or used < 0:
            raise ValueError(
                f"the checkpoint's data position is batches_used={used!r}; "
                "expected a count of batches >= 0"
            )
        self.batches_used = used
