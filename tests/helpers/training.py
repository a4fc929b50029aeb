"""Composing the real configs, training the smoke experiment, and comparing training states.

Needs the ``train`` extra (Hydra, Lightning); Hydra is imported when a config is composed.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
from lightning.pytorch import Callback
from torch import nn

from multihead.training import TranslationModule

from helpers import CONFIG_DIR
from helpers.models import PAD

if TYPE_CHECKING:
    from omegaconf import DictConfig


def compose_config(name: str, overrides: list[str]) -> DictConfig:
    """Compose ``configs/<name>.yaml`` with ``overrides``, exactly as the scripts do."""
    from multihead.cli import register_resolvers

    from hydra import compose, initialize_config_dir

    register_resolvers()  # as scripts/train.py does
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def smoke_overrides(out: Path, multi30k_dir: Path, cache_dir: Path) -> list[str]:
    """The smoke experiment on the raw Multi30k, with a CSV logger, writing into ``out``."""
    return [
        "experiment=smoke",
        "logger=csv",
        f"data.local_dir={multi30k_dir}",
        f"paths.output_dir={out}",
        f"paths.cache_dir={cache_dir}",
    ]


def train_smoke_run(out: Path, multi30k_dir: Path, cache_dir: Path) -> Path:
    """Train the smoke experiment for 20 steps into ``out``: checkpoints at steps 10 and 20,
    and last (the session's ``smoke_run_dir``)."""
    from multihead.training.run import train

    cfg = compose_config(
        "train",
        [
            *smoke_overrides(out, multi30k_dir, cache_dir),
            "trainer.max_steps=20",
            "trainer.val_check_interval=10",
            "test=false",
            "summary.decode_speed=false",
        ],
    )
    train(cfg)
    return out


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    """The rows of a run's ``csv/metrics.csv``."""
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


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


class PrecisionProbe(Callback):
    """Records what the training steps really ran, into a JSON file (a callback that a test adds
    as ``+callbacks.probe._target_=helpers.training.PrecisionProbe``).

    The dtypes of every ``nn.Linear`` output in training mode, and after each step the loss,
    the loss scale and the number of Adam steps taken.
    """

    def __init__(self, out: str) -> None:
        self.out = out
        self.dtypes: set[str] = set()
        self.steps: list[dict] = []
        self.handles: list = []

    def on_train_start(self, trainer, pl_module) -> None:
        for layer in pl_module.model.modules():
            if isinstance(layer, nn.Linear):
                self.handles.append(layer.register_forward_hook(self.record))

    def record(self, layer, args, output) -> None:
        if layer.training:
            self.dtypes.add(str(output.dtype))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        (optimizer,) = trainer.optimizers
        self.steps.append(
            {
                "loss": float(outputs["loss"]),
                "scale": trainer.precision_plugin.scaler.get_scale(),
                "adam_steps": sorted({int(s["step"]) for s in optimizer.state.values()}),
            }
        )

    def on_train_end(self, trainer, pl_module) -> None:
        for handle in self.handles:
            handle.remove()
        record = {"dtypes": sorted(self.dtypes), "steps": self.steps}
        Path(self.out).write_text(json.dumps(record))


# --------------------------------------------------------------------------- resuming
def assert_same_training_state(a: dict, b: dict) -> None:
    """Every tensor of the model, optimiser and scheduler, the step, the epoch, the loops'
    progress counters and the data position (the translation sampler's, or the LM's batches used).

    Not the module's count of validation runs (``multihead.val_runs``): a step checkpoint is
    written just before its step's validation and holds the count before it, which a resume
    does not repeat (docs/reliability.md, "Known gaps").
    """
    assert (a["global_step"], a["epoch"]) == (b["global_step"], b["epoch"])
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key
    for opt_a, opt_b in zip(a["optimizer_states"], b["optimizer_states"], strict=True):
        assert opt_a["param_groups"] == opt_b["param_groups"]
        for i, state in opt_a["state"].items():
            for name, value in state.items():
                assert torch.equal(value, opt_b["state"][i][name]), (i, name)
    assert a["lr_schedulers"] == b["lr_schedulers"]
    assert a["loops"] == b["loops"]
    data = [key for key in a if key.endswith("DataModule")]
    assert data, "the checkpoint holds no data position"
    assert [a[key] for key in data] == [b.get(key) for key in data]  # the data position


class StopAfter(Callback):
    """Stops ``fit`` after step ``step``, as a run stopped from outside would end."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


# step{N}.ckpt; step{N}-v1.ckpt, the name Lightning gives a second file of the same step; and
# the temporary file a write of either goes through (.step{N}.ckpt.<random>.tmp).
STEP_FILE = re.compile(r"\.?step(\d+)(-v\d+)?\.ckpt(\..+\.tmp)?")


def listing(ckpt_dir: Path) -> dict[str, tuple[int, int]]:
    """Each file in ``ckpt_dir``: its inode and modification time, which any rewrite changes."""
    found = {}
    for path in ckpt_dir.iterdir() if ckpt_dir.is_dir() else []:
        try:
            stat = path.stat()
        except FileNotFoundError:  # renamed or removed meanwhile, by a run that is writing
            continue
        found[path.name] = (stat.st_ino, stat.st_mtime_ns)
    return found


def written_steps(before: dict, after: dict) -> list[int]:
    """The steps whose checkpoint files were written (or begun) between two listings."""
    return sorted(
        int(match[1])
        for name, stamp in after.items()
        if before.get(name) != stamp and (match := STEP_FILE.fullmatch(name))
    )


def assert_resumed_from(step: int, before: dict, after: dict) -> None:
    """The launch between the two listings restored ``step`` > 0: it wrote no checkpoint of
    that step or an earlier one, as a run that started over (or further back) would."""
    assert step > 0, "there was no checkpoint to resume from"
    again = [n for n in written_steps(before, after) if n <= step]
    assert not again, f"a checkpoint of step {again[0]} was written again: no resume at {step}"
