"""The fused, chunked loss against F.cross_entropy on the full logits, at tiny sizes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from multihead.training import TranslationModule
from multihead.training.loss import linear_cross_entropy
from tests.model.tiny_models import PAD, VOCAB, random_src, tiny_model


def make_module(model, **options) -> TranslationModule:
    """The module around ``model`` with the recipe's loss and search settings."""
    return TranslationModule(
        model,
        SimpleNamespace(pad_id=PAD),
        optimizer=torch.optim.Adam,
        label_smoothing=0.1,
        beam_size=1,
        length_penalty=1.0,
        max_len_a=1.2,
        max_len_b=10,
        **options,
    )


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


def test_bf16_projection_is_close_to_fp32() -> None:
    hidden, weight, targets = inputs(torch.float32)
    losses, grads = [], []
    for bf16 in (False, True):
        loss, _ = linear_cross_entropy(
            hidden, weight, targets, ignore_index=PAD, label_smoothing=0.1, bf16=bf16
        )
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, (hidden, weight)))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-2, atol=1e-2)
    for grad, ref_grad in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=2e-2 * ref_grad.abs().max())


def rdrop_reference(hidden, weight, targets, label_smoothing, alpha):
    """R-Drop's fairseq criterion on unfused logits, divided by its two passes.

    Its loss is (sum of both passes' cross-entropy + alpha * (KL(p1||p2) + KL(p2||p1)) / 2,
    summed over the real positions) / (real positions of one pass).
    """
    logp = F.log_softmax(hidden @ weight.T, dim=-1)  # (2B, T, V)
    flat = logp.reshape(-1, weight.shape[0]), targets.reshape(-1)
    ce = F.nll_loss(*flat, ignore_index=PAD, reduction="sum")
    smooth = -(logp.mean(-1) * targets.ne(PAD)).sum()
    ce = (1 - label_smoothing) * ce + label_smoothing * smooth
    lp1, lp2 = logp.chunk(2)
    kl = F.kl_div(lp1, lp2, log_target=True, reduction="none")
    kl = kl + F.kl_div(lp2, lp1, log_target=True, reduction="none")
    real = targets.chunk(2)[0].ne(PAD)  # (B, T)
    kl = (kl.sum(-1) * real).sum()
    return (ce + alpha * kl / 2) / real.sum() / 2


@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
def test_rdrop_loss_and_gradients_equal_the_papers_criterion(chunk_size) -> None:
    hidden, weight, targets = inputs()
    # Two "passes": the same targets, different states (as two dropout masks give).
    hidden = torch.cat([hidden, hidden + 0.3 * torch.randn_like(hidden)]).detach().requires_grad_()
    targets = torch.cat([targets, targets])
    ref = rdrop_reference(hidden, weight, targets, 0.1, alpha=5.0)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    loss, _ = linear_cross_entropy(
        hidden,
        weight,
        targets,
        ignore_index=PAD,
        label_smoothing=0.1,
        chunk_size=chunk_size,
        rdrop_alpha=5.0,
    )
    grads = torch.autograd.grad(loss, (hidden, weight))
    torch.testing.assert_close(loss, ref)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad)
    with torch.no_grad():
        plain, _ = linear_cross_entropy(
            hidden, weight, targets, ignore_index=PAD, label_smoothing=0.1
        )
    assert loss > plain  # the KL term is positive for different passes


def test_rdrop_needs_two_copies_of_the_targets() -> None:
    hidden, weight, targets = inputs()
    with pytest.raises(ValueError, match="rdrop_alpha must be >= 0, got -1.0"):
        linear_cross_entropy(hidden, weight, targets, ignore_index=PAD, rdrop_alpha=-1.0)
    with pytest.raises(ValueError, match=r"rdrop_alpha=5.0 needs .* shape \(3, 7\)"):
        linear_cross_entropy(hidden, weight, targets, ignore_index=PAD, rdrop_alpha=5.0)


def test_module_rdrop_runs_the_batch_twice_with_two_dropout_masks() -> None:
    model = tiny_model(dropout=0.3).double().train()
    module = make_module(model, rdrop_alpha=5.0)
    batch = {"src": random_src(4, 9, seed=1), "tgt": random_src(4, 8, seed=2, min_len=2)}
    torch.manual_seed(0)
    loss, ntokens = module.loss(batch)
    # The same dropout draws, made by the unfused network on the doubled batch.
    torch.manual_seed(0)
    src, tgt = torch.cat([batch["src"]] * 2), torch.cat([batch["tgt"]] * 2)
    states = model.decoder_states(src, tgt[:, :-1])
    ref = rdrop_reference(states, model.output_projection.weight, tgt[:, 1:], 0.1, alpha=5.0)
    torch.testing.assert_close(loss, ref)
    assert ntokens == int(batch["tgt"][:, 1:].ne(PAD).sum())  # one pass's tokens
    with pytest.raises(ValueError, match="module.rdrop_alpha must be >= 0, got -1"):
        make_module(model, rdrop_alpha=-1)
