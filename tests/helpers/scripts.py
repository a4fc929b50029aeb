"""Running the scripts: in a subprocess, or their ``main`` in this process.

A subprocess imports torch, Lightning and Hydra again (seconds on 2 cores), so each script
has one subprocess test that proves its one-line error wrapper is wired (the message on
stderr in one line, exit status 2, no traceback); the other cases call the same ``main`` in
this process through :func:`script_main`, or the function that raises, through
:func:`fails_in_one_line`. Needs the ``train`` extra.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from helpers import REPO_ROOT
from helpers.training import compose_config


def run_script(
    script: str, *args: str, stdin: str | None = None, preexec_fn=None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:  # fmt: skip
    """``python scripts/<script> ARGS`` offline, from the repository root, with ``env``
    added to this process's environment.

    One OpenMP thread unless ``env`` names another count, as this process has (conftest.py):
    the models are tiny, and beside other jobs a script's second thread waits on the first
    (a conversion study of 47 s of CPU ran past 300 s at load 8). The limit is a guard against
    a hang: about 12x the longest script run here (that study, about 50 s on an idle core)."""
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", **(env or {}),
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
    }  # fmt: skip
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / script), *args],
        capture_output=True,
        text=True,
        input=stdin,
        env=env,
        cwd=REPO_ROOT,
        timeout=600,
        preexec_fn=preexec_fn,
    )


def assert_one_error_line(result: subprocess.CompletedProcess, message: str) -> str:
    """A script's user error: exit status 2, no traceback, and one ``error: ...`` line on
    stderr, which holds ``message`` (what a library logged before it may be there too).
    Returns that line."""
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert message in errors[0], errors[0]
    return errors[0]


@functools.cache
def _load(script: str):
    path = REPO_ROOT / "scripts" / script
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def script_module(script: str):
    """``scripts/<script>`` imported as a module (its ``main`` not run)."""
    return _load(script)


def script_main(script: str, config: str, *overrides: str):
    """Run ``scripts/<script>``'s ``main`` in this process on ``configs/<config>.yaml`` with
    ``overrides``: ``hydra.main`` hands a given config straight to the function it wraps, so
    this is the script past Hydra's command-line parsing, its error wrapper included."""
    return script_module(script).main(compose_config(config, list(overrides)))


def fails_in_one_line(fn: Callable, capsys: pytest.CaptureFixture, *args, **kwargs) -> str:
    """Run ``fn`` as a script's ``main`` runs (inside ``exit_on_user_error``); return its one
    ``error: ...`` line, after checking the exit status 2 and that it is stderr's last line.

    ``fn`` may be :func:`script_main` itself: the script's own wrapper exits first.
    """
    from multihead.cli import exit_on_user_error

    capsys.readouterr()  # what came before
    with pytest.raises(SystemExit) as stop:
        exit_on_user_error(fn)(*args, **kwargs)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    # One error line, the last thing written (a progress bar may have drawn before it).
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and err[-1] == errors[0], err
    return errors[0]
