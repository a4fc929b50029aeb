"""A training step waits for the device once (issue 36, item 4), counted on the CPU.

tests/fake_cuda counts the same on fake CUDA tensors, GradScaler included (its own inf check
is a second wait in fp16).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from multihead.training.callbacks import TokenThroughput

from helpers import HostReads
from helpers.models import random_src, tiny_model
from helpers.training import make_module


@pytest.mark.parametrize("finite", [True, False])
def test_a_training_step_reads_the_device_once(finite: bool) -> None:
    module = make_module(tiny_model().train(), on_non_finite_loss="skip")
    module._trainer = SimpleNamespace(
        world_size=1, global_step=0, is_global_zero=True, progress_bar_callback=None
    )
    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)
    monitor = TokenThroughput(log_every_n_steps=2)
    monitor.on_train_start(None, module)
    monitor.on_train_batch_start(None, module, None, 0)
    host = {"src": random_src(4, 9, seed=1), "tgt": random_src(4, 8, seed=2, min_len=2)}
    batch = module.transfer_batch_to_device(host, torch.device("cpu"), 0)  # host data
    if not finite:
        module.model.output_projection.weight.data[0, 0] = float("nan")
    with HostReads() as reads:
        loss = module.training_step(batch, 0)
        step = reads.count
        if finite:
            loss.backward()  # not counted: only CUDA's kernels tell what backward waits for
            reads.count = step
            module.on_before_optimizer_step(None)
        monitor.on_train_batch_end(None, module, loss, batch, 0)  # no window closes yet
    assert (loss is None) == (not finite)
    assert step == 1 and reads.count == 1
    if finite:  # logged as tensors: nothing read back
        assert isinstance(logged["train/loss"], torch.Tensor)
        assert isinstance(logged["train/grad_norm"], torch.Tensor)
