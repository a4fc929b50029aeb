"""``trainer.precision``: what ``auto`` picks on each kind of machine."""

from __future__ import annotations

import pytest
import torch

from multihead.training.precision import resolve_precision


def fake_gpu(monkeypatch: pytest.MonkeyPatch, native_bf16: bool) -> None:
    """A CUDA device whose bf16 is native (A100, H100) or only emulated (V100, T4).

    torch's own check says True on both unless emulation is excluded.
    """

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return native_bf16 or including_emulation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)


@pytest.mark.parametrize("accelerator", ["gpu", "cuda", "auto"])
@pytest.mark.parametrize(
    "native_bf16, expected", [(True, "bf16-mixed"), (False, "16-mixed")], ids=["a100", "v100"]
)
def test_auto_picks_bf16_only_where_the_gpu_has_it_natively(
    monkeypatch, accelerator, native_bf16, expected
) -> None:
    fake_gpu(monkeypatch, native_bf16)
    assert resolve_precision("auto", accelerator) == expected
    assert resolve_precision("auto", "cpu") == "32-true"
    assert resolve_precision("bf16-mixed", accelerator) == "bf16-mixed"  # asked for: kept
