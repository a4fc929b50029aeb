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
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# Positions projected at a time: (512, 8000) fp32 logits are 16 MB. Chosen with
# scripts/benchmark_training.py (docs/benchmarks.md).
DEFAULT_CHUNK_SIZE = 512


def _symmetric_kl(logp: Tensor, with_grad: bool) -> tuple[Tensor, Tensor | None]:
    """R-Drop's term: the sum over pairs of KL(p1 || p2) + KL(p2 || p1), and its gradient.

    ``logp`` is ``(2C, V)``: rows ``[0, C)`` and ``[C, 2C)`` are the two dropout passes'
    log-probabilities for the same C targets. The gradient is with respect to the logits:
    d KL(p1 || p2) / d z1 = p1 * (log p1 - log p2 - KL(p1 || p2)) and
    d KL(p2 || p1) / d z1 = p1 - p2; those for z2 mirror them.
    """
    lp1, lp2 = logp.chunk(2)  # (C, V) each
    p1, p2 = lp1.exp(), lp2.exp()
    diff = lp1 - lp2  # (C, V)
    kl12 = (p1 * diff).sum(1, keepdim=True)  # (C, 1)
    kl21 = -(p2 * diff).sum(1, keepdim=True)
    total = (kl12 + kl21).sum()
    if not with_grad:
        return total, None
    grad1 = p1 * (diff - kl12) + p1 - p2
    grad2 = -p2 * (diff + kl21) + p2 - p1
    return total, torch.cat([grad1, grad2])  # (2C, V)


class _LinearCrossEntropy(torch.autograd.Function):
    """Sums of the smoothed loss and of the NLL over the rows; gradients made in forward.

    The backward pass would need the chunk's probabilities again, so the forward pass
    computes the gradients right away (as Liger-Kernel's fused linear cross-entropy does)
    and the backward pass only scales them by the incoming gradient.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        label_smoothing: float,
        chunk_size: int,
        bf16: bool,
        with_grad: bool,
        rdrop_weight: float,
    ) -> tuple[Tensor, Tensor]:
        # hidden (N, E) real positions only, weight (V, E), targets (N,)
        vocab_size = weight.shape[0]
        # bf16 changes only the three GEMMs' operands; softmax, loss and sums stay in fp32.
        gemm_dtype = torch.bfloat16 if bf16 else hidden.dtype
        gemm_hidden, gemm_weight = hidden.to(gemm_dtype), weight.to(gemm_dtype)
        smooth = label_smoothing / vocab_size  # the smoothed target puts this on every class
        confidence = 1.0 - label_smoothing  # ... and this on top of it on the true class
        loss_sum = hidden.new_zeros(())
        nll_sum = hidden.new_zeros(())
        grad_hidden = torch.empty_like(hidden) if with_grad else None
        grad_weight = torch.zeros_like(weight) if with_grad else None
        weight_sum = weight.sum(0) if with_grad else None  # (E,)
        # With R-Drop, row i and row half + i are two dropout passes over the same target,
        # so a chunk takes rows [start, end) of each half, stacked: (2C, ...).
        half = hidden.shape[0] // 2 if rdrop_weight else hidden.shape[0]
        for start in range(0, half, chunk_size):
            rows = slice(start, min(start + chunk_size, half))
            if rdrop_weight:  # the chunk's rows in both halves
                first = torch.arange(rows.start, rows.stop, device=hidden.device)
                rows = torch.cat([first, first + half])
            h = hidden[rows]  # (C, E)
            gemm_h = gemm_hidden[rows]
            t = targets[rows]  # (C,)
            logits = (gemm_h @ gemm_weight.T).to(hidden.dtype)  # (C, V)
            logp = torch.log_softmax(logits, dim=1)
            nll = -logp.gather(1, t[:, None]).squeeze(1)  # (C,)
            # Smoothed cross-entropy: (1 - eps) * nll + eps * mean over classes of -log p.
            loss_sum += confidence * nll.sum() - label_smoothing * logp.mean(dim=1).sum()
            nll_sum += nll.sum()
            if rdrop_weight:
                kl_sum, kl_grad = _symmetric_kl(logp, with_grad)
                loss_sum += rdrop_weight * kl_sum
            if not with_grad:
                continue
            # d loss / d logits = softmax - q, with q the smoothed target distribution
            # (smooth everywhere, plus confidence at the target). Only the softmax goes
            # through the GEMMs; q's share of them is a row gather and a sum over rows, so
            # the (C, V) matrix is never rewritten to subtract q.
            probs = logp.exp_()  # (C, V)
            if rdrop_weight:
                probs += rdrop_weight * kl_grad
            probs = probs.to(gemm_dtype)
            grad_hidden[rows] = (
                (probs @ gemm_weight).to(hidden.dtype)
                - confidence * weight[t]
                - smooth * weight_sum
            )  # (C, E)
            if bf16:  # addmm_ cannot accumulate bf16 products into fp32
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
        return grad_hidden * grad_loss, grad_weight * grad_loss, *[None] * 6


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    ignore_index: int,
    label_smoothing: float = 0.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    bf16: bool = False,
    rdrop_alpha: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Label-smoothed cross-entropy of the logits ``hidden @ weight.T``, chunk by chunk.

    Args:
        hidden: ``(..., E)`` states before the output projection (e.g. ``(B, T, E)``).
        weight: ``(V, E)`` the output projection's weight (a bias-free linear layer).
        targets: ``(...)`` class ids, the shape of ``hidden`` without ``E``.
        ignore_index: targets equal to it (padding) count neither in the loss nor in the mean.
        label_smoothing: epsilon, in [0, 1).
        chunk_size: positions projected at a time.
        bf16: run the projection's three GEMMs (logits, gradients of the states and of the
            weight) on bfloat16 operands. Each GEMM's result is rounded to bf16; softmax,
            loss and the sum of the weight gradient over chunks stay fp32.
        rdrop_alpha: R-Drop (Liang et al., 2021). The first and second half of the batch
            (dim 0 of ``hidden`` and ``targets``) are two dropout passes over the same
            examples. The loss is then the mean smoothed cross-entropy over both passes
            plus ``rdrop_alpha / 4`` times the mean, over the pairs of real positions, of
            KL(p1 || p2) + KL(p2 || p1): the objective of the paper's fairseq criterion
            (its ``--reg-alpha``) divided by 2, the number of passes.

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
    if rdrop_alpha < 0:
        raise ValueError(f"rdrop_alpha must be >= 0, got {rdrop_alpha}")
    if rdrop_alpha and (targets.shape[0] % 2 or not torch.equal(*targets.chunk(2))):
        raise ValueError(
            f"rdrop_alpha={rdrop_alpha} needs a batch made of two copies of the same targets "
            f"along dim 0; got targets of shape {tuple(targets.shape)} whose halves differ"
        )
    targets = targets.reshape(-1)
    real = targets.ne(ignore_index).nonzero().squeeze(1)  # (N,) positions that count
    states = hidden.reshape(-1, hidden.shape[-1])  # (B*T, E)
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss_sum, nll_sum = _LinearCrossEntropy.apply(
        states[real],
        weight,
        targets[real],
        label_smoothing,
        chunk_size,
        bf16,
        with_grad,
        rdrop_alpha / 2,
    )
    count = real.numel()
    return loss_sum / count, nll_sum / count
