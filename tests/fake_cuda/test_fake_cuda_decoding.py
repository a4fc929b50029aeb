"""Greedy and beam decoding on the fake cuda:0: every backend that decodes, sentences leaving
the batch or not, and at most one wait for the device per step."""

from __future__ import annotations

import itertools

import pytest
import torch
from harness import (
    BOS,
    CUDA,
    EOS,
    Answers,
    FakeCuda,
    autocast,
    kernel_stubs,
    model_on_cpu,
    padded,
)

from multihead.model import beam_search, greedy_decode

pytestmark = pytest.mark.fake_cuda
# The most a decoding step may wait for the device (issue 36, item 4).
SYNCS_PER_DECODING_STEP = 1
LIMIT = 5  # every length limit reads as 5 (Answers.integer): 6 steps at most


def _leaving(rule: str):
    """How many rows of ``done`` go on (Answers.keep): none, one less per step, or all."""
    if rule == "all_finish_at_once":
        return lambda n: 0
    if rule == "one_leaves_per_step":
        return lambda n: n - 1
    return lambda n: n  # none finishes before its length limit


def _decode(search: str, backend: str, rule: str, precision=torch.bfloat16):
    fake = FakeCuda(Answers(integer=LIMIT, keep=_leaving(rule)))
    with kernel_stubs() as calls:
        model = fake.model(model_on_cpu(backend=backend)).eval()
        starts = []
        decode = model.decode

        def step(*args, **kwargs):  # marks where each step begins
            starts.append(len(fake.syncs))
            return decode(*args, **kwargs)

        model.decode = step
        with fake, autocast(precision):
            src = padded((4, 6), CUDA)
            limits = dict(bos_id=BOS, eos_id=EOS, max_len_a=1.0, max_len_b=2)
            if search == "greedy":
                out = greedy_decode(model, src, **limits)
            else:
                out = beam_search(model, src, beam_size=3, length_penalty=1.0, **limits)
    bounds = [*starts, len(fake.syncs)]
    per_step = [fake.syncs[a:b] for a, b in itertools.pairwise(bounds)]
    return out, fake.syncs[: starts[0]], per_step, calls


@pytest.mark.parametrize("rule", ["all_finish_at_once", "one_leaves_per_step", "run_to_limit"])
@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_decoding_waits_once_per_step(search: str, rule: str) -> None:
    out, before, per_step, _ = _decode(search, "sdpa", rule)
    assert len(out) == 4 and all(isinstance(t, int) for row in out for t in row)
    expected_steps = {"all_finish_at_once": 1, "one_leaves_per_step": 4, "run_to_limit": LIMIT + 1}
    assert len(per_step) == expected_steps[rule]
    assert [s.op for s in before] == ["copy to host"]  # the length limits, read once
    for syncs in per_step[:-1]:
        assert len(syncs) <= SYNCS_PER_DECODING_STEP, syncs
    # The last step's read, then the tokens copied to the host once.
    assert len(per_step[-1]) <= SYNCS_PER_DECODING_STEP + 1, per_step[-1]
    assert per_step[-1][-1].op == "copy to host"


DECODING_BACKENDS = ["math", "sdpa", "efficient", "flex", "flash_attn"]


@pytest.mark.parametrize("search", ["greedy", "beam"])
@pytest.mark.parametrize("backend", DECODING_BACKENDS)
def test_every_backend_decodes(backend: str, search: str) -> None:
    out, _, per_step, calls = _decode(search, backend, "one_leaves_per_step")
    assert len(out) == 4 and len(per_step) == 4
    kernel = {"math": None, "sdpa": None}.get(backend, backend)
    assert set(calls) == ({kernel} if kernel else set())


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_cudnn_decodes(search: str) -> None:
    out, _, _, calls = _decode(search, "cudnn", "one_leaves_per_step")
    assert len(out) == 4 and "cudnn" in calls
