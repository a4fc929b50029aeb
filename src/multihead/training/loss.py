"""The training loss: label-smoothed cross-entropy fused with the output projection.

The output projection of this model is its largest matmul, and its logits, ``(N, V)`` with
``N`` target positions and ``V`` the vocabulary, are the largest tensor of a step (about
3,800 x 8,000 floats, 120 MB, for a 4,096-token batch). Unfused, ``log_softmax``, the
label-smoothing sum and their backward each stream that tensor and its gradient through
memory several times. :func:`linear_cross_entropy` instead projects ``chunk_size`` positions
at a time, takes the loss and its gradient for the chunk while the chunk's logits are still
in cache, and keeps only the gradients of the hidden states and of the weight. Padded
positions are dropped before the projection, so they cost nothing.

The loss and gradients equal ``F.cross_entropy(hidden @ weight.T, targets,
ignore_index=ignore_index, label_smoothing=label_smoothing)`` (mean over the real tokens)
up to float rounding; ``tests/training/test_loss.py`` checks that.

:func:`distillation_kl` is the term a distilled uptraining adds: the KL divergence from a
frozen teacher's next-token distribution to the student's.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

# Positions projected at a time: (512, 8000) fp32 logits are 16 MB. Chosen with
# scripts/benchmark_training.py (docs/benchmarks.md).
DEFAULT_CHUNK_SIZE = 512


class _LinearCrossEntropy(torch.autograd.Function):
    """Sums of the smoothed loss and of the NLL over the rows; gradients made in forward.

    The backward pass would need the chunk's probabilities again, so the forward pass
    computes the gradients right away (as Liger-Kernel's fused linear cross-entropy does)
    and the backward pass only scales them by the incoming gradient. Runs with autocast
    off: ``gemm_dtype`` alone says which precision the three GEMMs use.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        label_smoothing: float,
        chunk_size: int,
        gemm_dtype: torch.dtype,
        with_grad: bool,
    ) -> tuple[Tensor, Tensor]:
        # hidden (N, E) real positions only, weight (V, E), both fp32 (or fp64); targets (N,)
        vocab_size = weight.shape[0]
        # A lower gemm_dtype changes only the three GEMMs' operands, and rounds their results;
        # softmax, loss and the weight gradient's sum over chunks stay in hidden's dtype.
        low_precision = gemm_dtype != hidden.dtype
        gemm_hidden, gemm_weight = hidden.to(gemm_dtype), weight.to(gemm_dtype)
        smooth = label_smoothing / vocab_size  # the smoothed target puts this on every class
        confidence = 1.0 - label_smoothing  # ... and this on top of it on the true class
        loss_sum = hidden.new_zeros(())
        nll_sum = hidden.new_zeros(())
        grad_hidden = torch.empty_like(hidden) if with_grad else None
        grad_weight = torch.zeros_like(weight) if with_grad else None
        weight_sum = weight.sum(0) if with_grad else None  # (E,)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            h = hidden[rows]  # (C, E)
            gemm_h = gemm_hidden[rows]
            t = targets[rows]  # (C,)
            logits = (gemm_h @ gemm_weight.T).to(hidden.dtype)  # (C, V)
            logp = torch.log_softmax(logits, dim=1)
            nll = -logp.gather(1, t[:, None]).squeeze(1)  # (C,)
            # Smoothed cross-entropy: (1 - eps) * nll + eps * mean over classes of -log p.
            loss_sum += confidence * nll.sum() - label_smoothing * logp.mean(dim=1).sum()
            nll_sum += nll.sum()
            if not with_grad:
                continue
            # d loss / d logits = softmax - q, with q the smoothed target distribution
            # (smooth everywhere, plus confidence at the target). Only the softmax goes
            # through the GEMMs; q's share of them is a row gather and a sum over rows, so
            # the (C, V) matrix is never rewritten to subtract q.
            probs = logp.exp_().to(gemm_dtype)  # (C, V)
            grad_hidden[rows] = (
                (probs @ gemm_weight).to(hidden.dtype)
                - confidence * weight[t]
                - smooth * weight_sum
            )  # (C, E)
            if low_precision:  # addmm_ cannot accumulate bf16/fp16 products into fp32
                grad_weight += probs.T @ gemm_h  # (V, E)
            else:
                grad_weight.addmm_(probs.T, h)
            grad_weight.index_add_(0, t, h, alpha=-confidence)
        if with_grad:
            grad_weight -= smooth * hidden.sum(0)  # q's uniform part, for all rows at once
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.mark_non_differentiable(nll_sum)
        return loss_sum, nll_sum

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_loss: Tensor, grad_nll: Tensor) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors  # made in forward (with_grad=True)
        return grad_hidden * grad_loss, grad_weight * grad_loss, *[None] * 5


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs matmuls in on ``device_type`` here, None when it is off."""
    if not torch.amp.is_autocast_available(device_type):
        return None
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    ignore_index: int,
    label_smoothing: float = 0.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    num_targets: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Label-smoothed cross-entropy of the logits ``hidden @ weight.T``, chunk by chunk.

    Precision. Softmax, loss and the weight gradient's sum over chunks are always fp32 (fp64
    for fp64 inputs; bf16/fp16 inputs are promoted). The three GEMMs (logits, gradients of
    the states and of the weight) run on:

    * under autocast with gradients (a mixed-precision training step), the autocast
      dtype's operands, as an unfused ``nn.Linear`` would run its forward and backward
      GEMMs there: the projection is the step's largest matmul, and fp32 would give back
      much of what mixed precision buys on a GPU;
    * else fp32, autocast or not: so a loss without gradients (validation, test) is fp32
      whatever precision the run trains in, and compares across runs.

    Each lower-precision GEMM's result is rounded to its dtype before it is used in fp32.

    Args:
        hidden: ``(..., E)`` states before the output projection (e.g. ``(B, T, E)``).
        weight: ``(V, E)`` the output projection's weight (a bias-free linear layer).
        targets: ``(...)`` class ids, the shape of ``hidden`` without ``E``.
        ignore_index: targets equal to it (padding) count neither in the loss nor in the mean.
        label_smoothing: epsilon, in [0, 1).
        chunk_size: positions projected at a time.
        num_targets: how many targets are not ``ignore_index``, when the caller counted
            them on the host (the training module does, before the batch moves to the GPU).
            Then the real positions are found without a host-device sync; otherwise finding
            them waits for the device once, to learn their number. It must be exact: a
            wrong count drops real targets or repeats the last position.

    Returns:
        ``(loss, nll)``: the label-smoothed loss and the plain negative log-likelihood (no
        gradient; its exp is the perplexity), both means over the real target tokens
        (NaN when there are none, as in ``F.cross_entropy``).
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree; "
            "expected hidden = targets' shape + (E,)"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be (V, E={hidden.shape[-1]}), got shape {tuple(weight.shape)}"
        )
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if num_targets is not None and not 0 <= num_targets <= targets.numel():
        raise ValueError(
            f"num_targets must be in [0, {targets.numel()}] (the targets given), got {num_targets}"
        )
    targets = targets.reshape(-1)
    counting = targets.ne(ignore_index)
    if num_targets is None:
        real = counting.nonzero().squeeze(1)  # (N,) positions that count
    else:
        real = torch.nonzero_static(counting, size=num_targets).squeeze(1)  # (N,), no sync
    states = hidden.reshape(-1, hidden.shape[-1])  # (B*T, E)
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    device_type = hidden.device.type
    autocast_dtype = _autocast_dtype(device_type)
    gemm_dtype = autocast_dtype if with_grad and autocast_dtype is not None else dtype
    # The casts stay outside the Function, so autograd returns gradients in the inputs' dtypes.
    args = (states[real].to(dtype), weight.to(dtype), targets[real])
    with torch.autocast(device_type, enabled=False) if autocast_dtype else nullcontext():
        loss_sum, nll_sum = _LinearCrossEntropy.apply(
            *args, label_smoothing, chunk_size, gemm_dtype, with_grad
        )
    count = real.numel()
    return loss_sum / count, nll_sum / count


def distillation_kl(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """``KL(teacher || student)`` per row, averaged: ``mean_i sum_v p_t log(p_t / p_s)``.

    Uptraining a converted model from the one it was converted from (X-EcoMLA's
    distillation, at temperature 1): the loss adds this, weighted, to the cross-entropy.
    Both ``(N, V)``, the rows the cross-entropy counts; computed in fp32 (or wider) whatever
    the autocast, its gradient reaching the student only.

    Raises:
        ValueError: the shapes differ or are not ``(N, V)``.
    """
    if student_logits.shape != teacher_logits.shape or student_logits.dim() != 2:
        raise ValueError(
            f"student {tuple(student_logits.shape)} and teacher {tuple(teacher_logits.shape)} "
            "logits must both be (N, V)"
        )
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    device_type = student_logits.device.type
    no_autocast = _autocast_dtype(device_type) is not None
    with torch.autocast(device_type, enabled=False) if no_autocast else nullcontext():
        log_p_student = torch.log_softmax(student_logits.to(dtype), dim=-1)
        log_p_teacher = torch.log_softmax(teacher_logits.detach().to(dtype), dim=-1)
        kl = torch.nn.functional.kl_div(
            log_p_student, log_p_teacher, reduction="sum", log_target=True
        )
    return kl / len(student_logits)
