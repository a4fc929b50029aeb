"""The fake-CUDA suite (``pytest -m fake_cuda tests/fake_cuda``; scripts/fake_cuda_check.sh).

It needs a CUDA build of torch, which the project's CPU virtualenv does not have: there the
tests are skipped, and the default run (``addopts``) leaves them out.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.version.cuda is not None:
        return
    skip = pytest.mark.skip(
        reason="the fake-CUDA suite needs a CUDA build of torch (scripts/fake_cuda_check.sh)"
    )
    for item in items:
        if "fake_cuda" in item.keywords:
            item.add_marker(skip)
