"""What the scripts share: user errors become one ``error: ...`` line and exit status 2,
and the config resolvers of their own.

The scripts need the ``train`` extra, the core (the layer and the model) does not. The
scripts import this module before any of the extra's packages, so that a core-only install
gets one line naming the extra instead of a traceback.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

from multihead.attention import BackendUnavailableError

# What the ``train`` extra of pyproject.toml installs, by import name.
TRAIN_MODULES = (
    "lightning",
    "hydra",
    "omegaconf",
    "datasets",
    "tokenizers",
    "sacrebleu",
    "sacremoses",
    "wandb",
    "matplotlib",
    "tqdm",
)


def require_train_extra() -> None:
    """Exit with status 2 and one ``error: ...`` line if a package of the extra is missing."""
    missing = [name for name in TRAIN_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"error: the scripts need the training extra ({', '.join(missing)} not installed): "
            "pip install 'multihead[train]'",
            file=sys.stderr,
        )
        sys.exit(2)


require_train_extra()

# After the check: these are the extra's.
from hydra.errors import InstantiationException  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402


def _full_precision(precision: str, accelerator: str) -> bool:
    # Imported when a training config is resolved: Lightning (seconds to import) is not
    # needed to evaluate, translate or export.
    from multihead.training.precision import resolve_precision

    return resolve_precision(precision, accelerator) == "32-true"


def _steps_share(steps: int, fraction: float) -> int:
    """``fraction`` of ``steps``, rounded down, at least 1 (a schedule's warmup, cooldown)."""
    return max(1, int(steps * fraction))


def register_resolvers() -> None:
    """``${path_name:PATH}``, the last component of a path (e.g. a sweep's time stamp),
    ``${full_precision:PRECISION,ACCELERATOR}``, whether the run trains in 32-true once
    ``auto`` is resolved (:func:`~multihead.training.precision.resolve_precision`), and
    ``${steps_share:STEPS,FRACTION}``, a part of a step budget (at least 1), so that a
    schedule keeps its shape at any ``trainer.max_steps``."""
    if not OmegaConf.has_resolver("steps_share"):
        OmegaConf.register_new_resolver("steps_share", _steps_share)
    if not OmegaConf.has_resolver("path_name"):
        OmegaConf.register_new_resolver("path_name", lambda path: Path(str(path)).name)
    if not OmegaConf.has_resolver("full_precision"):
        OmegaConf.register_new_resolver("full_precision", _full_precision)


# Errors caused by what the user gave us (config values, files, checkpoints, input) or by
# where they asked us to write (OSError: a read-only or full disk, a path through a file).
# Our code raises these with messages meant for users; a TypeError is more often a bug, so
# it keeps its traceback (a wrongly typed config value still arrives as
# InstantiationException).
USER_ERRORS = (
    ValueError,
    OSError,
    BackendUnavailableError,
    InstantiationException,
)


def one_line(err: BaseException) -> str:
    """The innermost user-facing message of ``err`` on a single line."""
    while isinstance(err, InstantiationException) and err.__cause__ is not None:
        err = err.__cause__
    text = " ".join(str(err).split())
    return text or type(err).__name__


def exit_on_user_error(fn: Callable) -> Callable:
    """Turn user errors into ``error: <message>`` on stderr and exit code 2, no traceback.

    ``HYDRA_FULL_ERROR=1`` re-raises instead, with the full traceback.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as err:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise  # developers asking for the whole traceback get it
            print(f"error: {one_line(err)}", file=sys.stderr)
            sys.exit(2)

    return wrapper
