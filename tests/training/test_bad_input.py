"""Bad config values that training meets: each gets one ``error: ...`` line, exit status 2.

Cases run in this process through :func:`multihead.cli.exit_on_user_error`, the wrapper every
script's ``main`` has; tests/scripts/test_train_script.py runs one through the real script. A
value that a part checks on its own is tested with that part: the layer's heads and backend
(tests/attention), the data module's (tests/data/test_datamodule.py), the schedule's and the
wall clock's (tests/training), a language that the data lacks (tests/data/test_loading.py), a
bad precision (tests/training/test_precision.py). Bad checkpoints and outputs are tested in
tests/checkpoints and tests/evaluation.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest

from multihead.training.run import train

from helpers import CONFIG_DIR
from helpers.scripts import fails_in_one_line


# ------------------------------------------------------------------------------- config
def unread_keys(*overrides: str) -> str | None:
    """What :func:`multihead.cli.check_config_keys` (the scripts' Hydra callback) refuses in
    the train config composed with ``overrides`` as a command line would, in its one line;
    None if nothing."""
    from multihead.cli import USER_ERRORS, check_config_keys, one_line, register_resolvers

    from hydra import compose, initialize_config_dir

    register_resolvers()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", [*overrides, "paths.output_dir=x"], return_hydra_config=True)
        try:
            check_config_keys(cfg)
        except USER_ERRORS as err:
            return one_line(err)
    return None


@pytest.mark.parametrize(
    "overrides",
    [
        ["++seed=2"],  # ++ on a key that exists sets it
        ["+trainer.fast_dev_run=true"],  # an argument the trainer's file leaves at its default
        ["+callbacks.stop._target_=helpers.training.StopAfter", "+callbacks.stop.step=3"],
        # the heads: the model checks them (tests/model); docs/long_context.md's command
        ["experiment=lm_long", "attention=mha_h8", "+attention.rotary_dim=8"],
        ["attention=moh", "++attention.design_options.top_k_heads=3"],
        ["logger=wandb", "logger.wandb.entity=my-team"],  # a team's runs: in the file
    ],
)
def test_added_keys_that_code_reads_pass(overrides) -> None:
    assert unread_keys(*overrides) is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["++summary.limitt=3"], "++summary.limitt=3 sets summary.limitt, which no code "
         "reads (closest: summary.limit)"),
        (["++callbacks.checkpoint_bestt.monitor=x"], "sets callbacks.checkpoint_bestt.monitor, "
         "which no code reads (closest: callbacks.checkpoint_best)"),
        (["+callbacks.stop._target_=helpers.training.StopAfter", "+callbacks.stop.stepp=3"],
         "callbacks.stop.stepp: helpers.training.StopAfter takes no argument 'stepp' (closest: "
         "'step')"),
        # WandbLogger takes **kwargs and hands them to wandb.init when it first logs, inside
        # the training loop: only the keys of its file are known
        (["++logger.wandb.projekt=x"], "sets logger.wandb.projekt, which no code reads "
         "(closest: logger.wandb.project)"),
        # a key of the file that another target does not take (Adam's betas, eps)
        (["module.optimizer._target_=torch.optim.SGD"], "module.optimizer.betas: "
         "torch.optim.SGD takes no argument 'betas' (it takes: params, lr, momentum,"),
        (["++nothing_like_it=1"], "sets nothing_like_it, which no code reads; the config has: "
         "task_name, objective, seed,"),
    ],
)  # fmt: skip
def test_keys_that_no_code_reads_are_named_with_the_closest(overrides, message) -> None:
    refused = unread_keys(*overrides)
    assert refused is not None and message in refused, refused


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.d_model=0", "d_model must be a positive integer, got 0"),
        ("model.num_encoder_layers=-2", "num_encoder_layers must be a positive integer, got -2"),
        ("model.dropout=1.5", "dropout must be a number in [0, 1), got 1.5"),
        ("attention.match_parameters=gqa", "attention.match_parameters='gqa'; expected null"),
        ("module.on_non_finite_loss=maybe", "module.on_non_finite_loss='maybe'"),
        ("module.beam_size=0", "module.beam_size must be >= 1, got 0"),
        ("test_ckpt=avg0", "test_ckpt=avg0; expected best, last, avg<N>"),
        ("test_ckpt=/nowhere.ckpt", "test_ckpt=/nowhere.ckpt: no such checkpoint"),
        ("ckpt_path=last", "ckpt_path=last: no checkpoint in"),
        # A switch is a bool: "no" was taken as True (issue 84).
        ("model.norm_first=no", "norm_first must be a bool, got 'no'"),
        ("model.share_embeddings=0", "share_embeddings must be a bool, got 0"),
        ("model.tie_output=nope", "tie_output must be a bool, got 'nope'"),
        ("test=no", "test must be a bool, got 'no'"),
        ("summary.decode_speed=off", "summary.decode_speed must be a bool, got 'off'"),
    ],
)
def test_bad_config_values(smoke_config, capsys, override, message) -> None:
    cfg = smoke_config(override, "trainer.max_steps=2", "trainer.val_check_interval=2")
    line = fails_in_one_line(train, capsys, cfg)
    assert message in line, line


@pytest.mark.parametrize(
    "installed, why",
    [
        (False, "the flash-attn package is not installed"),
        (True, "flash-attn runs on CUDA in fp16/bf16 only (got cpu/torch.float32)"),
    ],
)
def test_a_backend_that_cannot_run_here_says_why(
    smoke_config, capsys, monkeypatch, installed, why
) -> None:
    """Whether or not flash-attn is installed here, it cannot run on the CPU in fp32."""
    if installed:  # what importlib finds for an installed package
        module = types.ModuleType("flash_attn")
        module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    else:  # importlib.util.find_spec then answers None, as for a package that is absent
        module = None
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    cfg = smoke_config("attention.backend=flash_attn", "trainer.max_steps=2")
    line = fails_in_one_line(train, capsys, cfg)
    assert "'flash_attn'" in line and why in line and "math" in line, line  # why; which can


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["attention.design=talking_heads"], "attention.backend=math"),
        # flash takes no padding mask: the design's refusal comes first all the same
        (["attention.design=talking_heads", "attention.backend=flash"], "attention.backend=math"),
        (
            ["attention.decoder_self_attention.design=talking_heads",
             "attention.decoder_self_attention.backend=sdpa"],
            "attention.decoder_self_attention.backend=math",
        ),
    ],
)  # fmt: skip
def test_a_design_and_its_backend_are_checked_before_the_data(
    smoke_config, capsys, monkeypatch, overrides, key
) -> None:
    """A design of the math kernel's hooks on another backend failed after data loading
    (12-17 s), without the override; with flash the padding-mask error came first."""
    from multihead.data import TranslationDataModule

    def no_data(self) -> None:
        raise AssertionError("the data were loaded before the model's settings were checked")

    monkeypatch.setattr(TranslationDataModule, "prepare_data", no_data)
    line = fails_in_one_line(train, capsys, smoke_config(*overrides))
    assert "head design 'talking_heads' runs on backend math only" in line, line
    assert line.endswith(f"set {key}"), line
