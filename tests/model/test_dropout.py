"""The model's dropout keeps nn.Dropout's distribution: statistical tests over ~10^7 draws.

Every bound is ``Z`` binomial standard deviations: a test fails by chance with probability
below 6e-7 (two-sided normal tail at 5 sigma), and each is seeded, so a failure repeats.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from multihead.model import Dropout
from multihead.model.dropout import dropout

from helpers.models import tiny_model

Z = 5.0
N = 10**7


def kept(p: float, n: int = N) -> torch.Tensor:
    """The keep mask of one dropout call on ``n`` ones, as booleans."""
    return dropout(torch.ones(n), p) != 0


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_keep_rate_is_within_1e_3_of_one_minus_p(p) -> None:
    torch.manual_seed(0)
    n = 4 * N  # sigma = sqrt(p (1 - p) / n) = 7.2e-5 at p = 0.3, so Z sigma = 3.6e-4
    rate = sum(int(kept(p).sum()) for _ in range(4)) / n
    sigma = math.sqrt(p * (1 - p) / n)
    # The 5-sigma interval around the observed rate lies inside (1 - p) +- 1e-3.
    assert abs(rate - (1 - p)) + Z * sigma < 1e-3


def test_each_16_bit_lane_of_a_64_bit_draw_keeps_one_minus_p() -> None:
    # Four mask elements share one 64-bit draw; a biased lane (e.g. a sign bit always 0
    # from a range that is not the full 64 bits) would keep nearly all or nothing.
    torch.manual_seed(1)
    p, mask = 0.3, kept(0.3).view(-1, 4)
    sigma = math.sqrt(p * (1 - p) / mask.shape[0])
    for lane in range(4):
        assert abs(mask[:, lane].double().mean().item() - (1 - p)) < Z * sigma + 2**-17


def joint_within_bound(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether P(a and b) is P(a) P(b) within Z sigma of the joint rate's estimate."""
    qa, qb = a.double().mean().item(), b.double().mean().item()
    joint = (a & b).double().mean().item()
    sigma = math.sqrt(qa * qb * (1 - qa * qb) / a.numel())
    return abs(joint - qa * qb) < Z * sigma


def test_two_masks_are_independent() -> None:
    torch.manual_seed(2)
    first, second = kept(0.3), kept(0.3)
    assert joint_within_bound(first, second)


@pytest.mark.parametrize("lag", [1, 2, 3, 4, 5, 8, 128])
def test_positions_in_one_mask_are_independent(lag) -> None:
    # Lags 1-3 fall inside one 64-bit draw, 4 and 8 on the same lane of the next draws.
    torch.manual_seed(3)
    mask = kept(0.3)
    assert joint_within_bound(mask[:-lag], mask[lag:])


def test_the_mean_is_preserved() -> None:
    torch.manual_seed(4)
    p = 0.3
    mean = dropout(torch.ones(N, dtype=torch.float64), p).mean().item()
    # Each element is 0 or 1/(1-p): variance p/(1-p); the threshold's quantisation moves
    # the keep probability by at most 2^-17.
    sigma = math.sqrt(p / (1 - p) / N)
    assert abs(mean - 1) < Z * sigma + 2**-17 / (1 - p)


def test_the_gradient_is_the_mask_over_one_minus_p() -> None:
    torch.manual_seed(5)
    p = 0.3
    x = torch.randn(6, 7, 9, requires_grad=True)  # 378 elements: not a multiple of 4
    grad_out = torch.randn(6, 7, 9)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = dropout(x, p)
    y.backward(grad_out)
    mask = (y != 0).float()  # randn has no exact zeros
    torch.testing.assert_close(y, x.detach() * mask / (1 - p))
    torch.testing.assert_close(x.grad, grad_out * mask / (1 - p))
    # Autograd keeps the boolean mask, one byte per element, and no float copy of it.
    assert [t.dtype for t in saved] == [torch.bool]


def test_eval_mode_and_p_zero_are_the_identity() -> None:
    x = torch.randn(4, 5)
    assert Dropout(0.3).eval()(x) is x
    assert Dropout(0.0)(x) is x


def test_seeded_calls_repeat_and_other_seeds_differ() -> None:
    x = torch.randn(1000)
    masks = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        masks.append(Dropout(0.3)(x) != 0)
    assert torch.equal(masks[0], masks[1])
    assert not torch.equal(masks[0], masks[2])


def test_it_keeps_the_dtype_under_autocast() -> None:
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert Dropout(0.3)(x).dtype == torch.bfloat16


@pytest.mark.parametrize("p", [1.0, -0.1, True, "0.3"])
def test_a_bad_p_is_named(p) -> None:
    with pytest.raises(ValueError, match=rf"dropout p must be a number in \[0, 1\), got {p!r}"):
        Dropout(p)


def test_the_model_uses_it_everywhere_outside_the_attention_layer() -> None:
    model = tiny_model(dropout=0.3, activation_dropout=0.1)
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())
    rates = sorted(m.p for m in model.modules() if isinstance(m, Dropout))
    # Two embeddings; per encoder layer the residual and FFN dropouts, the same per decoder
    # layer: tiny_model's layers are counted from the model itself.
    layers = len(model.encoder_layers) + len(model.decoder_layers)
    assert rates == [0.1] * layers + [0.3] * (2 + layers)
