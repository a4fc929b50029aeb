"""Timing jobs side by side, the one way every speed figure here is measured (torch only).

Jobs timed one after the other are compared at different moments of a machine that trainings
and other processes share. :func:`interleaved_seconds` calls every job once per round, in
turn, so that whatever else the machine does slows them alike;
:func:`interleaved_medians` gives each job's median. ``scripts/compare.py
speed=true`` (:mod:`multihead.analysis.speed`), ``scripts/benchmark_training.py``,
``scripts/benchmark_decoding.py``, ``scripts/benchmark_attention.py`` and
``scripts/benchmark_heads.py`` all time through it.

:func:`op_shares` says where one job's time goes, op by op (``torch.profiler``), as the
table of ``scripts/benchmark_training.py --profile``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

import torch
from torch.profiler import ProfilerActivity, profile

K = TypeVar("K", bound=Hashable)

# The ops grouped into one row of :func:`op_shares`: the matrix products (the step's floor)
# and the attention kernels, forward and backward.
OP_GROUPS = {
    "GEMMs (mm, addmm, addmm_, bmm, baddbmm)": (
        lambda name: (
            name in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm")
        )
    ),
    "SDPA kernels, forward and backward": lambda name: "scaled_dot_product" in name,
}


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


def op_shares(job: Callable[[], Any], *, min_share: float = 0.01) -> list[tuple[str, float, float]]:
    """Self CPU seconds of the ops of one call of ``job``, from ``torch.profiler``.

    The ops of each :data:`OP_GROUPS` entry are summed into one row; any other op with at
    least ``min_share`` of the total has a row of its own, largest first; the rest sum to a
    last row, ``"everything else"``. On CUDA the times are the host's (launches and
    synchronizations), not the kernels'.

    Returns:
        ``[(op, self CPU seconds, share of the total), ...]``; the shares sum to 1.
    """
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        job()
    seconds: dict[str, float] = {}
    for event in prof.key_averages():
        seconds[event.key] = seconds.get(event.key, 0.0) + event.self_cpu_time_total / 1e6
    total = sum(seconds.values())
    grouped = {group: 0.0 for group in OP_GROUPS}
    others: dict[str, float] = {}
    for name, s in seconds.items():
        group = next((g for g, member in OP_GROUPS.items() if member(name)), None)
        if group is None:
            others[name] = s
        else:
            grouped[group] += s
    rest = 0.0
    for name, s in sorted(others.items(), key=lambda item: -item[1]):
        if s >= min_share * total:
            grouped[name] = s
        else:
            rest += s
    grouped["everything else"] = rest
    return [(name, s, s / total) for name, s in grouped.items()]
