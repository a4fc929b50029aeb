"""WallClock: minutes survive a resume; one slow step past two marks saves once.

Under DDP rank 0 decides when a mark has passed: the 2-process training test covers it.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from multihead.training import WallClock


def fake_trainer():
    saved: list[str] = []
    return (
        SimpleNamespace(
            world_size=1,
            global_step=7,
            save_checkpoint=saved.append,
        ),
        saved,
    )


def test_state_round_trip_keeps_counting_from_the_saved_minutes() -> None:
    clock = WallClock(save_at_minutes=[30, 60], dirpath="ckpts")
    clock.start = time.monotonic() - 45 * 60  # as if 45 minutes had passed
    state = clock.state_dict()
    assert state["elapsed_min"] == pytest.approx(45, abs=0.01) and state["marks"] == [30, 60]

    resumed = WallClock(save_at_minutes=[30, 60], dirpath="ckpts")
    resumed.load_state_dict(state)
    assert resumed.elapsed_min() == pytest.approx(45, abs=0.01)
    trainer, saved = fake_trainer()
    resumed.on_train_batch_end(trainer, None, None, None, 0)
    assert saved == ["ckpts/minute030-step7.ckpt"] and resumed.marks == [60]


def test_one_slow_step_past_two_marks_saves_once() -> None:
    clock = WallClock(save_at_minutes=[15, 30, 60], dirpath="d")
    clock.start = time.monotonic() - 31 * 60
    trainer, saved = fake_trainer()
    clock.on_train_batch_end(trainer, None, None, None, 0)
    assert saved == ["d/minute015-step7.ckpt"] and clock.marks == [60]


def test_marks_must_be_minutes_after_the_start(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"save_at_minutes must be minutes > 0, got \[0\]"):
        WallClock(save_at_minutes=[0], dirpath=str(tmp_path))
