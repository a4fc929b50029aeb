"""Distillation from the unconverted model while uptraining (issue 67): the KL term against a
KL written out here, the loss of both modules, a teacher without gradients that no checkpoint
holds, and the training run's ``distill_from``."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from multihead.training.loss import distillation_kl

from helpers.models import PAD, VOCAB, random_src, tiny_model
from helpers.training import compose_config, make_module, read_metrics, smoke_overrides


def kl_by_hand(student: torch.Tensor, teacher: torch.Tensor) -> float:
    """mean over rows of sum_v p_t (log p_t - log p_s), in Python floats."""
    total = 0.0
    for s_row, t_row in zip(student.double().tolist(), teacher.double().tolist(), strict=True):
        s_norm = math.log(sum(math.exp(v) for v in s_row))
        t_norm = math.log(sum(math.exp(v) for v in t_row))
        for s, t in zip(s_row, t_row, strict=True):
            p_t = math.exp(t - t_norm)
            total += p_t * ((t - t_norm) - (s - s_norm))
    return total / len(student)


def test_the_kl_is_teacher_to_student_and_only_the_student_gets_a_gradient():
    student = torch.randn(5, 7, requires_grad=True)
    teacher = torch.randn(5, 7, requires_grad=True)
    kl = distillation_kl(student, teacher)
    assert kl.item() == pytest.approx(kl_by_hand(student.detach(), teacher.detach()), rel=1e-6)
    assert distillation_kl(teacher, teacher).item() == pytest.approx(0.0, abs=1e-6)
    kl.backward()
    assert student.grad is not None and teacher.grad is None
    with pytest.raises(ValueError, match=re.escape("student (5, 7) and teacher (5, 6) logits")):
        distillation_kl(student, teacher[:, :6])


def translation_batch():
    src = random_src(3, 6, seed=1)
    tgt = random_src(3, 5, seed=2)  # padded rows: (3, 5), PAD after each row's length
    return {"src": src, "tgt": tgt}


def test_the_translation_loss_is_the_cross_entropy_plus_the_weighted_kl():
    """The reference: both models' logits, label-smoothed cross-entropy and the KL by hand
    over the real target tokens; backward leaves the teacher without gradients."""
    student, teacher = tiny_model(seed=0).train(), tiny_model(seed=1)
    module = make_module(student, teacher=teacher, distill_weight=0.5)
    assert teacher.training is False and not any(p.requires_grad for p in teacher.parameters())
    assert not any(k.startswith("teacher") or "_teacher" in k for k in module.state_dict())
    assert {id(p) for p in module.parameters()} == {id(p) for p in student.parameters()}
    batch = translation_batch()
    tgt_in, tgt_out = batch["tgt"][:, :-1], batch["tgt"][:, 1:]
    real = tgt_out.ne(PAD)
    torch.manual_seed(0)
    states = student.decoder_states(batch["src"], tgt_in)
    loss, _, _ = module._losses(batch, states)
    kl = module.distillation(batch, states)
    total = loss + module.distill_weight * kl
    with torch.no_grad():
        student_logits = (states @ student.output_projection.weight.T)[real]
        teacher_logits = teacher(batch["src"], tgt_in)[real]
    ce = F.cross_entropy(student_logits, tgt_out[real], label_smoothing=0.1)
    assert loss.item() == pytest.approx(ce.item(), rel=1e-5)
    assert kl.item() == pytest.approx(kl_by_hand(student_logits, teacher_logits), rel=1e-5)
    total.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert student.output_projection.weight.grad is not None


def test_the_language_model_loss_adds_the_kl_over_the_predicted_positions():
    transformers = pytest.importorskip("transformers")
    from multihead.training.lm import LanguageModelModule

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    student = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    teacher = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    module = LanguageModelModule(student, torch.optim.AdamW, teacher=teacher, distill_weight=2.0)
    batch = torch.randint(3, VOCAB, (2, 9))
    with pytest.warns(UserWarning, match="self.log"):  # no trainer here to log to
        loss = module.training_step(batch, 0)
    with torch.no_grad():
        s, t = student(input_ids=batch).logits[:, :-1], teacher(input_ids=batch).logits[:, :-1]
        ce = F.cross_entropy(s.flatten(0, 1), batch[:, 1:].flatten())
    want = ce.item() + 2.0 * kl_by_hand(s.flatten(0, 1), t.flatten(0, 1))
    assert loss.item() == pytest.approx(want, rel=1e-5)
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert not any("teacher" in k for k in module.state_dict())
    with pytest.raises(ValueError, match="distill_weight must be > 0, got 0"):
        LanguageModelModule(student, torch.optim.AdamW, teacher=teacher, distill_weight=0)
    # A weight with nothing to weigh is refused, not dropped, by both modules.
    with pytest.raises(ValueError, match=r"distill_weight=2.0 weighs .* no teacher"):
        LanguageModelModule(student, torch.optim.AdamW, distill_weight=2.0)
    with pytest.raises(ValueError, match=r"module.distill_weight=2.0 weighs .* no teacher"):
        make_module(tiny_model(seed=0), distill_weight=2.0)


def test_a_run_distilling_from_a_checkpoint_logs_the_kl_and_saves_the_student_alone(
    smoke_run_dir, tmp_path, multi30k_dir, cache_dir
):
    """scripts/train.py init_from=CKPT distill_from=CKPT: 2 steps; the checkpoint holds the
    same parameter names as the teacher's own (nothing of the teacher added)."""
    from multihead.training.run import train

    teacher = smoke_run_dir / "checkpoints" / "last.ckpt"
    overrides = [
        *smoke_overrides(tmp_path, multi30k_dir, cache_dir), "trainer.max_steps=2",
        "trainer.val_check_interval=2", "trainer.log_every_n_steps=1", "test=false",
        "summary.decode_speed=false", f"init_from={teacher}", f"distill_from={teacher}",
    ]  # fmt: skip
    train(compose_config("train", overrides))
    saved = torch.load(
        tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False
    )
    original = torch.load(teacher, map_location="cpu", weights_only=False)
    assert set(saved["state_dict"]) == set(original["state_dict"])
    kl = [float(row["train/kl"]) for row in read_metrics(tmp_path) if row.get("train/kl")]
    assert len(kl) == 2 and all(k >= 0 for k in kl)
    bad = compose_config("train", [*overrides[:-1], f"distill_from={tmp_path / 'none.ckpt'}"])
    with pytest.raises(FileNotFoundError):
        train(bad)
