"""The fused loss and its gradients, an optimizer step (GradScaler in fp16, plain in bf16),
and the host-device syncs of a training step, on the fake cuda:0."""

from __future__ import annotations

import pytest
import torch
from harness import (
    AUTOCAST,
    CUDA,
    PAD,
    Answers,
    FakeCuda,
    autocast,
    host_batch,
    one_step,
    padded,
    training_module,
)

from multihead.training.callbacks import TokenThroughput
from multihead.training.loss import _LinearCrossEntropy, linear_cross_entropy
from multihead.training.module import NonFiniteLossError

pytestmark = pytest.mark.fake_cuda
# The most a training step may wait for the device (issue 36, item 4).
SYNCS_PER_TRAINING_STEP = 2


@pytest.mark.parametrize("precision", AUTOCAST)
@pytest.mark.parametrize("num_targets", [None, 11, 0])
def test_fused_loss_and_its_gradients(precision: str, num_targets: int | None) -> None:
    """With and without the host's count; no real target at all (0) too."""
    fake = FakeCuda(Answers(keep=lambda n: 11 if num_targets is None else n))
    with fake, autocast(AUTOCAST[precision]):
        hidden = torch.randn(3, 6, 64, device=CUDA, requires_grad=True)
        weight = torch.randn(48, 64, device=CUDA, requires_grad=True)
        targets = padded((3, 6), CUDA)
        with fake.counting() as syncs:
            loss, nll = linear_cross_entropy(
                hidden, weight, targets, ignore_index=PAD, label_smoothing=0.1,
                chunk_size=4, num_targets=num_targets,
            )  # fmt: skip
        # What autograd's backward would call: the Function's own backward.
        gemm = AUTOCAST[precision] or torch.float32
        real = 11 if num_targets is None else num_targets
        rows, w = torch.randn(real, 64, device=CUDA), weight.detach()
        loss_sum, nll_sum = _LinearCrossEntropy.apply(
            rows.requires_grad_(), w.requires_grad_(), targets.view(-1)[:real], 0.1, 4, gemm, True
        )
        grad_rows, grad_weight, *rest = loss_sum.grad_fn.apply(torch.ones((), device=CUDA), None)
    assert (loss.device, loss.dtype, nll.dtype) == (CUDA, torch.float32, torch.float32)
    assert [s.op for s in syncs] == (["nonzero"] if num_targets is None else [])
    assert grad_rows.shape == (real, 64) and grad_weight.shape == (48, 64)
    assert grad_rows.device == grad_weight.device == CUDA
    assert grad_rows.dtype == grad_weight.dtype == torch.float32
    assert rest == [None] * 5


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_training_step_waits_for_the_device_at_most_twice(precision: str) -> None:
    # The host counts the real targets (no sync: a CPU tensor); here that count reads 20.
    fake = FakeCuda(Answers(integer=20))
    module = training_module(fake)
    monitor = TokenThroughput(log_every_n_steps=3)
    monitor.on_train_start(None, module)
    with fake:
        optimizer = module.configure_optimizers()["optimizer"]
        scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
        per_step = []
        for _ in range(3):
            with fake.counting() as syncs:
                loss = one_step(fake, module, optimizer, scaler, monitor, precision)
            per_step.append(syncs)
    assert loss is not None and loss.device == CUDA
    # Metrics are logged as device tensors, not read back.
    assert {n for n, v in module.logged.items() if isinstance(v, torch.Tensor)} >= {
        "train/loss",
        "train/grad_norm",
    }
    assert all(v.device == CUDA for v in module.logged.values() if isinstance(v, torch.Tensor))
    state = optimizer.state[next(module.parameters())]
    assert state["exp_avg"].device == CUDA and state["exp_avg"].dtype == torch.float32
    # The throughput window (every 3 steps) reads its counts once, after a synchronize.
    window = [s.op for s in per_step[2] if "callbacks.py" in s.site]
    assert window == ["synchronize", "copy to host"]
    for syncs in per_step:
        step = [s for s in syncs if "callbacks.py" not in s.site]
        assert len(step) <= SYNCS_PER_TRAINING_STEP, fake.counts


@pytest.mark.parametrize("found_inf", [0.0, 1.0])
def test_grad_scaler_steps_or_skips(found_inf: float) -> None:
    fake = FakeCuda(Answers(integer=20, real=found_inf))
    module = training_module(fake)
    with fake:
        optimizer = module.configure_optimizers()["optimizer"]
        scaler = torch.amp.GradScaler("cuda")
        one_step(fake, module, optimizer, scaler, TokenThroughput(10), "fp16")
    # GradScaler skips the optimizer step when it found an inf: no Adam state then.
    assert (len(optimizer.state) > 0) == (found_inf == 0.0)


@pytest.mark.parametrize("on_non_finite_loss", ["skip", "stop"])
def test_non_finite_loss_is_caught_on_the_device(on_non_finite_loss: str) -> None:
    """Both sides of the finite check: the answer True says the loss is NaN."""
    fake = FakeCuda(Answers(integer=20, flag=True))
    module = training_module(fake, on_non_finite_loss=on_non_finite_loss)
    with fake:
        batch = module.transfer_batch_to_device(host_batch(), CUDA, 0)
        if on_non_finite_loss == "stop":
            with pytest.raises(NonFiniteLossError, match="at step 0"):
                module.training_step(batch, 0)
        else:
            assert module.training_step(batch, 0) is None
    assert module.skipped_batches == (on_non_finite_loss == "skip")
