"""``multihead.timing``: jobs in turn, round by round, warm-up untimed, CUDA synchronized.

The jobs advance a fake clock by known amounts, so every figure is exact."""

from __future__ import annotations

import torch

from multihead import timing


def fake_jobs(monkeypatch, costs: dict[str, list[float]], calls: list[str]) -> dict:
    """Jobs that log their name and advance the timer's clock by their next cost."""
    clock = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])

    def job(name: str):
        left = iter(costs[name])

        def run() -> None:
            calls.append(name)
            clock[0] += next(left)

        return run

    return {name: job(name) for name in costs}


def test_every_round_times_each_job_once_in_turn_after_untimed_warm_up(monkeypatch) -> None:
    calls: list[str] = []
    costs = {"a": [9.0, 9.0, 1.0, 2.0, 0.5], "b": [8.0, 8.0, 0.25, 4.0, 0.75]}
    jobs = fake_jobs(monkeypatch, costs, calls)
    times = timing.interleaved_seconds(jobs, 3, warmup=2)
    assert calls == ["a", "b"] * 5
    assert times == {"a": [1.0, 2.0, 0.5], "b": [0.25, 4.0, 0.75]}


def test_medians_are_of_the_timed_rounds(monkeypatch) -> None:
    jobs = fake_jobs(monkeypatch, {"a": [100.0, 3.0, 1.0, 2.0], "b": [0.0, 5.0, 7.0, 6.0]}, [])
    assert timing.interleaved_medians(jobs, 3) == {"a": 2.0, "b": 6.0}


def test_a_cuda_job_is_timed_between_synchronizes(monkeypatch) -> None:
    calls: list[str] = []
    jobs = fake_jobs(monkeypatch, {"a": [1.0, 1.0, 1.0], "b": [2.0, 2.0]}, calls)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda device: calls.append("sync"))
    timing.interleaved_seconds(jobs, 1, device=torch.device("cuda"))
    # Warm-up unsynchronized; each timed call has a synchronize on either side.
    assert calls == ["a", "b", "sync", "a", "sync", "sync", "b", "sync"]
    calls.clear()
    timing.wall_seconds(jobs["a"], torch.device("cpu"))  # no CUDA: nothing to wait for
    assert calls == ["a"]
