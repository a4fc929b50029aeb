"""The run summary's decoding speed: a warm-up outside the timing, the training's precision."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from omegaconf import OmegaConf

from multihead.training import run

from helpers.models import tiny_model

SENTENCES = [f"sentence {i}" for i in range(10)]


@pytest.mark.parametrize(
    "plugin, autocast_dtype",
    [
        (MixedPrecision("bf16-mixed", "cpu"), torch.bfloat16),
        (MixedPrecision("16-mixed", "cpu"), torch.float16),
        (Precision(), None),  # 32-true
    ],
    ids=["bf16-mixed", "16-mixed", "32-true"],
)
def test_each_search_is_warmed_up_untimed_and_runs_in_the_training_precision(
    plugin, autocast_dtype, monkeypatch
) -> None:
    events: list[tuple] = []
    model = tiny_model().train()

    def translate(net, tokenizer, sentences, *, beam_size, batch_size, **settings):
        assert net is model and not net.training and torch.is_inference_mode_enabled()
        autocast = torch.is_autocast_enabled("cpu")
        dtype = torch.get_autocast_dtype("cpu") if autocast else None
        events.append(("decode", len(sentences), beam_size, dtype))
        return [""] * len(sentences)

    clock = itertools.count()

    def perf_counter() -> float:
        events.append(("clock",))
        return float(next(clock))

    monkeypatch.setattr(run, "translate", translate)
    monkeypatch.setattr(run.time, "perf_counter", perf_counter)
    module = SimpleNamespace(model=model, decode_settings={"length_penalty": 1.0})
    datamodule = SimpleNamespace(tokenized={"test": {"src": SENTENCES}}, tokenizer=None)
    cfg = OmegaConf.create(
        {"summary": {"split": "test", "limit": None, "beam_size": 3, "batch_size": 4}}
    )
    result = run.decode_summary(
        module, datamodule, torch.device("cpu"), cfg, plugin.forward_context
    )
    assert events == [
        ("decode", 4, 1, autocast_dtype),  # one batch, untimed
        ("clock",),
        ("decode", 10, 1, autocast_dtype),
        ("clock",),
        ("decode", 4, 3, autocast_dtype),
        ("clock",),
        ("decode", 10, 3, autocast_dtype),
        ("clock",),
    ]
    # 10 sentences in one tick of the fake clock each.
    assert result == {"decode/greedy_sentences_per_s": 10.0, "decode/beam3_sentences_per_s": 10.0}
