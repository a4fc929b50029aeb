"""The fake device itself: it catches a tensor made on the wrong device, runs CUDA's autocast
policy, and answers and records each read of device data."""

from __future__ import annotations

import pytest
import torch
from harness import CUDA, Answers, FakeCuda, autocast, model_on_cpu, padded

from multihead.model.transformer import FeedForward

pytestmark = pytest.mark.fake_cuda


def _forward(fake: FakeCuda) -> torch.Tensor:
    model = fake.model(model_on_cpu())
    with fake:
        src, tgt = padded((3, 7), CUDA), padded((3, 5), CUDA)
        with autocast(torch.bfloat16):
            return model.decoder_states(src, tgt)


def test_a_tensor_made_without_device_fails(monkeypatch) -> None:
    out = _forward(FakeCuda())
    assert out.device == CUDA and out.shape == (3, 5, 64)

    forward = FeedForward.forward

    def planted(self, x):  # the bug the suite is for: a constant made on the default device
        return forward(self, x) * torch.ones(x.shape[-1])

    monkeypatch.setattr(FeedForward, "forward", planted)
    with pytest.raises(RuntimeError, match="cuda:0 and cpu"):
        _forward(FakeCuda())


@pytest.mark.parametrize(
    ("dtype", "matmul_dtype"),
    [(None, torch.float32), *[(d, d) for d in (torch.float16, torch.bfloat16)]],
)
def test_autocast_runs_cuda_policy(dtype, matmul_dtype) -> None:
    fake = FakeCuda()
    linear = fake.model(torch.nn.Linear(8, 4))
    with fake, autocast(dtype):
        x = torch.randn(2, 8, device=CUDA)
        assert linear(x).dtype == matmul_dtype
        # Softmax is on CUDA's fp32 list: it runs in fp32 whatever the input.
        assert torch.softmax(linear(x), dim=-1).dtype == torch.float32


@pytest.mark.parametrize("flag", [False, True])
def test_reads_are_answered_and_recorded(flag: bool) -> None:
    fake = FakeCuda(Answers(flag=flag, integer=7, keep=lambda n: n - 1))
    with fake:
        x = torch.randn(5, device=CUDA)
        taken = bool(x.gt(0).any())
        size = int(x.argmax())
        kept = x.gt(0).nonzero()
        host = torch.arange(3, device=CUDA).tolist()
        cpu_scalar = int(torch.tensor(4))  # a CPU tensor: no wait for the device
    assert (taken, size, kept.shape, host, cpu_scalar) == (flag, 7, (4, 1), [7, 7, 7], 4)
    assert [s.op for s in fake.syncs] == ["item", "item", "nonzero", "copy to host"]
    assert all(s.site.startswith("test_harness.py:") for s in fake.syncs)
