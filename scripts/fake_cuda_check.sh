#!/usr/bin/env bash
# The fake-CUDA suite (tests/fake_cuda) in one command, on a machine with or without a GPU.
# It needs a CUDA build of torch 2.13.0: the CPU build aborts when it builds an autograd
# graph on fake CUDA tensors. That build lives in its own virtualenv, made on the first run
# (about 4.7 GB), so the project's CPU virtualenv is left alone.
#
#   scripts/fake_cuda_check.sh [PYTEST ARGS...]
#
# The virtualenv: $FAKE_CUDA_VENV, default .fake-cuda-venv in the checkout. The torch
# version: $FAKE_CUDA_TORCH, default 2.13.0 (another where the index has that CUDA build
# only, e.g. FAKE_CUDA_TORCH=2.14.1).
# Run it after every change to device, dtype or kernel code (docs/gpu.md).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
venv=${FAKE_CUDA_VENV:-$repo/.fake-cuda-venv}

torch_version=${FAKE_CUDA_TORCH:-2.13.0}
ready="import torch, pytest, multihead, transformers; assert torch.__version__.split('+')[0] == '$torch_version' and torch.version.cuda"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "$ready" 2>/dev/null; then
    echo "fake_cuda_check: making $venv (torch $torch_version, CUDA build)" >&2
    python3 -m venv "$venv"
    # `torch===2.13.0` (arbitrary equality) matches the release without a local tag, so pip
    # takes the CUDA build rather than a `2.13.0+cpu` file that find-links may offer.
    "$venv/bin/python" -m pip install -q "torch===$torch_version"
    # torch is already there and satisfies the project's range, so pip does not touch it.
    # [dev] brings the [hf] extra: transformers, for test_fake_cuda_huggingface.py.
    "$venv/bin/python" -m pip install -q -e ".[dev]"
fi

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
# This checkout's code, whatever the virtualenv has installed.
export PYTHONPATH="$repo/src:$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$venv/bin/python" -m pytest -q -m fake_cuda tests/fake_cuda "$@"
