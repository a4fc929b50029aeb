"""The fused, chunked loss against F.cross_entropy on the full logits, at tiny sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._ops import ops
from torch.utils._python_dispatch import TorchDispatchMode

from multihead.training.loss import linear_cross_entropy

from helpers.models import PAD, VOCAB, random_src, tiny_model
from helpers.training import make_module

aten = ops.aten


def reference(hidden, weight, targets, label_smoothing):
    logits = hidden @ weight.T  # (B, T, V)
    flat = logits.reshape(-1, weight.shape[0]), targets.reshape(-1)
    loss = F.cross_entropy(*flat, ignore_index=PAD, label_smoothing=label_smoothing)
    return loss, F.cross_entropy(*flat, ignore_index=PAD)


def inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 7, 16, generator=g, dtype=dtype, requires_grad=True)  # (B, T, E)
    weight = torch.randn(50, 16, generator=g, dtype=dtype, requires_grad=True)  # (V, E)
    targets = torch.randint(1, 50, (3, 7), generator=g)
    targets[0, 4:] = PAD  # right-padded rows, one without padding
    targets[2, 6:] = PAD
    return hidden, weight, targets


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk_size", [1, 4, 17, 1000])
def test_loss_nll_and_gradients_equal_unfused(label_smoothing, chunk_size) -> None:
    hidden, weight, targets = inputs()
    ref_loss, ref_nll = reference(hidden, weight, targets, label_smoothing)
    ref_grads = torch.autograd.grad(3.0 * ref_loss, (hidden, weight))
    loss, nll = linear_cross_entropy(
        hidden,
        weight,
        targets,
        ignore_index=PAD,
        label_smoothing=label_smoothing,
        chunk_size=chunk_size,
    )
    # An upstream factor (DDP's token weighting) scales the gradients as it would unfused.
    grads = torch.autograd.grad(3.0 * loss, (hidden, weight))
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(nll, ref_nll)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad)
    assert not grads[0][0, 4:].any()  # padded positions get no gradient


def test_float32_within_float_tolerance() -> None:
    hidden, weight, targets = inputs(torch.float32)
    ref_loss, _ = reference(hidden, weight, targets, 0.1)
    ref_grads = torch.autograd.grad(ref_loss, (hidden, weight))
    loss, _ = linear_cross_entropy(hidden, weight, targets, ignore_index=PAD, label_smoothing=0.1)
    grads = torch.autograd.grad(loss, (hidden, weight))
    torch.testing.assert_close(loss, ref_loss)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad)


def test_without_gradients_and_all_padding() -> None:
    hidden, weight, targets = inputs()
    with torch.no_grad():
        loss, nll = linear_cross_entropy(hidden, weight, targets, ignore_index=PAD)
        ref_loss, _ = reference(hidden, weight, targets, 0.0)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(nll, ref_loss)
    padding = torch.full_like(targets, PAD)
    loss, _ = linear_cross_entropy(hidden, weight, padding, ignore_index=PAD)
    assert loss.isnan() and reference(hidden, weight, padding, 0.0)[0].isnan()


def test_bad_arguments_name_the_value() -> None:
    hidden, weight, targets = inputs()
    with pytest.raises(ValueError, match=r"hidden \(3, 7, 16\) and targets \(3, 6\)"):
        linear_cross_entropy(hidden, weight, targets[:, :6], ignore_index=PAD)
    with pytest.raises(ValueError, match=r"weight must be \(V, E=16\), got shape \(50, 8\)"):
        linear_cross_entropy(hidden, weight[:, :8], targets, ignore_index=PAD)
    with pytest.raises(ValueError, match="label_smoothing must be in \\[0, 1\\), got 1.0"):
        linear_cross_entropy(hidden, weight, targets, ignore_index=PAD, label_smoothing=1.0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        linear_cross_entropy(hidden, weight, targets, ignore_index=PAD, chunk_size=0)


def test_a_count_from_the_host_finds_the_same_positions() -> None:
    """``num_targets`` (counted on the host) replaces the read-back count, nothing else."""
    hidden, weight, targets = inputs()
    count = int(targets.ne(PAD).sum())
    ref_loss, ref_nll = reference(hidden, weight, targets, 0.1)
    ref_grads = torch.autograd.grad(ref_loss, (hidden, weight))
    loss, nll = linear_cross_entropy(
        hidden, weight, targets, ignore_index=PAD, label_smoothing=0.1, num_targets=count
    )
    torch.testing.assert_close((loss, nll), (ref_loss, ref_nll))
    for grad, ref_grad in zip(torch.autograd.grad(loss, (hidden, weight)), ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad)
    with pytest.raises(ValueError, match=r"num_targets must be in \[0, 21\] .* got 22"):
        linear_cross_entropy(hidden, weight, targets, ignore_index=PAD, num_targets=22)


def test_the_trainer_counts_targets_before_the_batch_moves() -> None:
    module = make_module(tiny_model())
    tgt = random_src(4, 8, seed=2, min_len=2)
    batch = module.transfer_batch_to_device({"src": random_src(4, 9), "tgt": tgt}, "cpu", 0)
    assert batch["num_targets"] == int(tgt[:, 1:].ne(PAD).sum())
    assert batch["tgt"] is tgt  # the batch itself is untouched


def test_module_loss_equals_cross_entropy_of_the_logits() -> None:
    """The training loss and its gradients (tied embedding included) as before the fusion."""
    model = tiny_model().double().train()  # dropout 0: both passes see the same network
    module = make_module(model)
    batch = {"src": random_src(4, 9, seed=1), "tgt": random_src(4, 8, seed=2, min_len=2)}
    loss, ntokens = module.loss(batch)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    logits = model(batch["src"], batch["tgt"][:, :-1])  # (B, T, V)
    targets = batch["tgt"][:, 1:].reshape(-1)
    ref = F.cross_entropy(logits.reshape(-1, VOCAB), targets, ignore_index=PAD, label_smoothing=0.1)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    torch.testing.assert_close(loss, ref)
    assert ntokens == int(targets.ne(PAD).sum())
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad)


class GemmDtypes(TorchDispatchMode):
    """Records the dtype of each matrix product's result, below autocast's casts."""

    GEMMS = (aten.mm, aten.addmm, aten.addmm_, aten.bmm)

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in self.GEMMS:
            self.dtypes.append(out.dtype)
        return out


AUTOCAST_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES, ids=["bf16", "fp16"])
def test_loss_without_gradients_is_fp32_under_autocast(dtype) -> None:
    """Validation and test losses: every GEMM in fp32 whatever precision the run trains in."""
    hidden, weight, targets = inputs(torch.float32)
    with torch.no_grad():
        ref_loss, ref_nll = reference(hidden, weight, targets, 0.1)
        with torch.autocast("cpu", dtype=dtype):
            with GemmDtypes() as gemms:
                loss, nll = linear_cross_entropy(
                    hidden, weight, targets, ignore_index=PAD, label_smoothing=0.1, chunk_size=9
                )
            # What the same loss gives on logits from a GEMM under autocast.
            low_loss, _ = reference(hidden, weight, targets, 0.1)
    assert gemms.dtypes == [torch.float32] * 2  # 17 real positions: chunks of 9 and 8
    assert loss.dtype == nll.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(nll, ref_nll)
    assert (low_loss - ref_loss).abs() > 1e-4  # a low-precision GEMM would not pass above


@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES, ids=["bf16", "fp16"])
def test_training_loss_runs_its_gemms_in_the_autocast_dtype(dtype) -> None:
    """A mixed-precision step: logits, state and weight gradients on autocast's operands."""
    hidden, weight, targets = inputs(torch.float32)
    ref_loss, _ = reference(hidden, weight, targets, 0.1)
    ref_grads = torch.autograd.grad(ref_loss, (hidden, weight))
    with torch.autocast("cpu", dtype=dtype), GemmDtypes() as gemms:
        loss, _ = linear_cross_entropy(
            hidden, weight, targets, ignore_index=PAD, label_smoothing=0.1, chunk_size=9
        )
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert gemms.dtypes == [dtype] * 6  # 2 chunks x (logits, state gradient, weight gradient)
    assert loss.dtype == torch.float32
    assert [g.dtype for g in grads] == [torch.float32] * 2
    assert loss != ref_loss
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=2e-2 * ref_grad.abs().max())


def test_fp32_training_loss_runs_its_gemms_in_fp32() -> None:
    hidden, weight, targets = inputs(torch.float32)
    with GemmDtypes() as gemms:
        loss, _ = linear_cross_entropy(hidden, weight, targets, ignore_index=PAD, chunk_size=9)
    torch.autograd.grad(loss, (hidden, weight))
    assert gemms.dtypes == [torch.float32] * 6
