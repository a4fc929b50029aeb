"""Timing jobs side by side, the one way every speed figure here is measured (torch only).

Jobs timed one after the other are compared at different moments of a machine that trainings
and other processes share. :func:`interleaved_seconds` calls every job once per round, in
turn, so that whatever else the machine does slows them alike;
:func:`interleaved_medians` gives each job's median. ``scripts/compare.py
speed=true`` (:mod:`multihead.analysis.speed`), ``scripts/benchmark_training.py``,
``scripts/benchmark_decoding.py``, ``scripts/benchmark_attention.py`` and
``scripts/benchmark_heads.py`` all time through it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

import torch

K = TypeVar("K", bound=Hashable)


def wall_seconds(job: Callable[[], Any], device: torch.device | None = None) -> float:
    """Wall seconds of one call of ``job``.

    On a CUDA ``device`` the clock starts and stops after a synchronize: kernels run
    asynchronously, and the work an earlier job queued belongs to that job, the work this
    one queued to this one.
    """
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    job()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def interleaved_seconds(
    jobs: Mapping[K, Callable[[], Any]],
    rounds: int,
    *,
    warmup: int = 1,
    device: torch.device | None = None,
) -> dict[K, list[float]]:
    """Wall seconds of each job in ``rounds`` rounds; each round calls every job once, in
    the order of ``jobs``.

    Args:
        jobs: the jobs by name, each called without arguments.
        rounds: timed rounds.
        warmup: untimed rounds before them (first calls pay for allocation, kernel choices
            and compilation).
        device: where the jobs run, as in :func:`wall_seconds`.

    Returns:
        ``{name: [seconds of round 1, ...]}``.
    """
    for _ in range(warmup):
        for job in jobs.values():
            job()
    times: dict[K, list[float]] = {name: [] for name in jobs}
    for _ in range(rounds):
        for name, job in jobs.items():
            times[name].append(wall_seconds(job, device))
    return times


def interleaved_medians(
    jobs: Mapping[K, Callable[[], Any]],
    rounds: int,
    *,
    warmup: int = 1,
    device: torch.device | None = None,
) -> dict[K, float]:
    """The median of each job's seconds in :func:`interleaved_seconds` (same arguments)."""
    times = interleaved_seconds(jobs, rounds, warmup=warmup, device=device)
    return {name: statistics.median(t) for name, t in times.items()}
