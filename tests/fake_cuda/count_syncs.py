"""Print the host-device syncs of a training step and of a decoding run on the fake cuda:0.

    PYTHONPATH=src:. python -m tests.fake_cuda.count_syncs     # in the fake-CUDA virtualenv

The figures of docs/gpu.md ("Host-device syncs"); put an older ``src`` first on PYTHONPATH
to count that tree. Each line gives the count, then the project lines that asked.
"""

from __future__ import annotations

from collections import Counter

import torch

from multihead.model import beam_search, greedy_decode
from multihead.training.callbacks import TokenThroughput
from tests.fake_cuda import harness
from tests.fake_cuda.harness import (
    BOS,
    CUDA,
    EOS,
    Answers,
    FakeCuda,
    autocast,
    one_step,
    padded,
    training_module,
)


def training_step(precision: str) -> str:
    fake = FakeCuda(Answers(integer=20))
    module = training_module(fake)
    monitor = TokenThroughput(log_every_n_steps=100)
    monitor.on_train_start(None, module)
    gradients = 0
    before_optimizer_step = module.on_before_optimizer_step

    def grad_norm(optimizer):
        # Lightning's grad_norm builds a host tensor from the device's per-parameter norms,
        # which the fake device cannot do: on a GPU that is one read per gradient.
        nonlocal gradients
        try:
            before_optimizer_step(optimizer)
        except RuntimeError:
            gradients = sum(p.grad is not None for p in module.parameters())

    module.on_before_optimizer_step = grad_norm
    with fake:
        optimizer = module.configure_optimizers()["optimizer"]
        scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
        one_step(fake, module, optimizer, scaler, monitor, precision)  # makes Adam's state
        with fake.counting() as syncs:
            one_step(fake, module, optimizer, scaler, monitor, precision)
    extra = f" + {gradients} in grad_norm" if gradients else ""
    return f"training step {precision}: {len(syncs)}{extra} {dict(Counter(s.site for s in syncs))}"


def decoding(search: str, steps: int = 11) -> str:
    # Every length limit reads as steps - 1 and no sentence ends early: `steps` steps.
    fake = FakeCuda(Answers(integer=steps - 1))
    model = fake.model(harness.model_on_cpu()).eval()
    with fake, autocast(torch.bfloat16):
        src = padded((4, 6), CUDA)
        limits = dict(bos_id=BOS, eos_id=EOS, max_len_a=1.0, max_len_b=2)
        with fake.counting() as syncs:
            if search == "greedy":
                greedy_decode(model, src, **limits)
            else:
                beam_search(model, src, beam_size=5, length_penalty=1.0, **limits)
    return f"{search}, {steps} steps: {len(syncs)} {dict(Counter(s.site for s in syncs))}"


if __name__ == "__main__":
    for line in (
        training_step("bf16"),
        training_step("fp16"),
        decoding("greedy"),
        decoding("beam"),
    ):
        print(line)
