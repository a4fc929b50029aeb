"""OmegaConf resolvers used by the Hydra configs, and the one-line error wrapper."""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from hydra.errors import InstantiationException
from omegaconf import OmegaConf

from multihead.attention import BackendUnavailableError

log = logging.getLogger(__name__)


def head_variant(num_heads: int, num_kv_heads: int | None) -> str:
    """``mha``, ``gqa`` or ``mqa`` for these head counts."""
    kv = num_heads if num_kv_heads is None else num_kv_heads
    if kv == num_heads:
        return "mha"
    return "mqa" if kv == 1 else "gqa"


def head_tag(num_heads: int, num_kv_heads: int | None, backend: str) -> str:
    """A run name that shows the head settings, e.g. ``gqa-h8-kv2-sdpa``."""
    kv = num_heads if num_kv_heads is None else num_kv_heads
    return f"{head_variant(num_heads, num_kv_heads)}-h{num_heads}-kv{kv}-{backend}"


def head_tags(num_heads: int, num_kv_heads: int | None, backend: str) -> list[str]:
    """wandb tags for the head settings, so runs can be filtered by each."""
    kv = num_heads if num_kv_heads is None else num_kv_heads
    return [
        head_variant(num_heads, num_kv_heads),
        f"heads={num_heads}",
        f"kv_heads={kv}",
        f"backend={backend}",
    ]


def path_name(path: str) -> str:
    """The last component of ``path`` (e.g. a sweep directory's time stamp)."""
    return Path(str(path)).name


def register_resolvers() -> None:
    for name, fn in (
        ("head_tag", head_tag),
        ("head_tags", head_tags),
        ("head_variant", head_variant),
        ("path_name", path_name),
    ):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


# Errors caused by what the user gave us (config values, files, checkpoints, input). Our
# code raises these with messages meant for users; a TypeError is more often a bug, so it
# keeps its traceback (a wrongly typed config value still arrives as InstantiationException).
USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    FileExistsError,
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
