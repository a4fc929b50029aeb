"""What the tests share that is not a fixture: paths, the Multi30k lookup, counting host reads.

``tests/conftest.py`` holds the fixtures and hooks, this package the plain helpers; no test
imports another test module. Importing this package and :mod:`helpers.models` needs torch
alone: tests/attention and tests/model also run where only the core is installed (.ci/run).
:mod:`helpers.training`, :mod:`helpers.scripts` and :mod:`helpers.ct2_models` (the export
tests' toy checkpoints) need the ``train`` extra.

pytest puts ``tests/`` on ``sys.path`` (the directory of the rootmost conftest.py), so tests
import this as ``helpers`` from whatever directory pytest is started in.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = str(REPO_ROOT / "configs")


def find_multi30k() -> Path | None:
    """``$MULTIHEAD_DATA_DIR`` if set, else ``../shared/data/multi30k`` beside the repository."""
    where = os.environ.get("MULTIHEAD_DATA_DIR")
    candidate = Path(where) if where else REPO_ROOT.parent / "shared/data/multi30k"
    return candidate if (candidate / "train.en.gz").is_file() else None


class HostReads(TorchDispatchMode):
    """Counts the ops that make the host wait for a GPU, run on the CPU.

    Reading a tensor's value (``.item()``, ``bool(t)``, ``int(t)``), ``nonzero`` (also inside
    ``x[mask]``) and ``equal`` cost nothing on the CPU, but on CUDA tensors each is a
    host-device sync: counted on a CPU step, they are that step's syncs on a GPU, except
    what only CUDA kernels do (tests/fake_cuda counts on fake CUDA tensors instead).
    """

    _READS = ("_local_scalar_dense", "is_nonzero", "item", "nonzero", "equal")
    _INDEX = ("index", "index_put", "index_put_")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self._READS:
            self.count += 1
        elif name in self._INDEX:  # a boolean mask index is a nonzero inside the op
            self.count += sum(
                i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]
            )
        return func(*args, **(kwargs or {}))
