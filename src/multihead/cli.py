"""What the scripts share: user errors become one ``error: ...`` line and exit status 2,
and the config resolvers of their own.

The scripts need the ``train`` extra, the core (the layer and the model) does not. The
scripts import this module before any of the extra's packages, so that a core-only install
gets one line naming the extra instead of a traceback.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from multihead.attention import BackendUnavailableError
from multihead.attention.checks import closest_name

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
from hydra.experimental.callback import Callback  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402


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


def exit_with(err: BaseException) -> None:
    """Print ``error: <message>`` of user error ``err`` on stderr and exit with status 2
    (``HYDRA_FULL_ERROR=1``: its traceback first)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        traceback.print_exception(err)
    print(f"error: {one_line(err)}", file=sys.stderr)
    sys.exit(2)


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
            exit_with(err)

    return wrapper


# ------------------------------------------------------------------ keys no code reads
# A node read whole by a function that refuses its unknown keys in one line itself: the
# heads, which the model checks against the layer's options and each design's
# (multihead.model.check_model_config; check_config_keys runs it, see _check_model).
CHECKED_WHERE_READ = ("attention",)


def _parameters(target: str) -> list[str] | None:
    """The keyword names that ``target`` (a ``_target_``) takes; ``None`` when it takes any
    (``**kwargs``: what it passes them to checks them) or cannot be located here
    (instantiating it then says why)."""
    # Resolved as instantiate resolves it (its check of the name first, then the import):
    # Hydra has no public function that does both.
    from hydra._internal.instantiate._instantiate2 import _resolve_target

    try:
        params = inspect.signature(_resolve_target(target, "")).parameters.values()
    except (InstantiationException, ValueError, TypeError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY)]


def _paths(node: Any, prefix: str = "") -> list[str]:
    """Every key of ``node`` (a plain container) as a dotted path, nodes and leaves."""
    if not isinstance(node, dict):
        return []
    paths = []
    for key, value in node.items():
        if str(key).startswith("_"):  # _target_, _partial_: Hydra's, not options
            continue
        path = f"{prefix}{key}"
        paths += [path, *_paths(value, f"{path}.")]
    return paths


def unread_constructor_keys(config: Mapping) -> list[str]:
    """Keys of the ``_target_`` nodes of ``config`` (a plain container) that their target's
    signature does not take, each with the closest parameter: the constructor would refuse
    them, but only once it is called (a ``_partial_`` one inside the training loop)."""
    problems = []

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{prefix}{i}.")
        if not isinstance(node, dict):
            return
        target = node.get("_target_")
        takes = _parameters(target) if isinstance(target, str) else None
        for key, value in node.items():
            if takes is not None and not str(key).startswith("_") and key not in takes:
                near = closest_name(str(key), takes)
                problems.append(
                    f"{prefix}{key}: {target} takes no argument {key!r}"
                    + (f" (closest: {near!r})" if near else f" (it takes: {', '.join(takes)})")
                )
            walk(value, f"{prefix}{key}.")

    walk(config, "")
    return problems


def _base_overrides(overrides: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """``overrides`` without the keys they add (``+key=``, ``++key=``; a sweep by its first
    value, as one job composes it), and the added ``(override, key)`` pairs."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    loader = GlobalHydra.instance().config_loader()
    base, added = [], []
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group
        is_group = "/" in key or bool(loader.get_group_options(key))
        if (override.is_add() or override.is_force_add()) and not is_group:
            if not key.startswith("hydra."):  # Hydra's own keys are Hydra's to check
                added.append((override.input_line, key))
        elif override.is_sweep_override():
            first = next(iter(override.sweep_string_iterator()))
            base.append(f"{override.get_key_element()}={first}")
        else:
            base.append(override.input_line)
    return base, added


def unread_added_keys(config: DictConfig) -> list[str]:
    """The ``+key=`` / ``++key=`` overrides of the command line that composed ``config``
    (with its ``hydra`` node) whose key no code reads, each with the closest real key.

    The keys that exist are those of the config the same command composes without the
    additions (the chosen defaults' config files). Keys added to a ``_target_`` node, or
    as a new node with a ``_target_`` of its own (a callback), are its target's to take:
    :func:`unread_constructor_keys` checks them against its signature.
    """
    from hydra import compose

    base_overrides, added = _base_overrides(list(config.hydra.overrides.task))
    if not added:
        return []
    base = compose(config.hydra.job.config_name, base_overrides)
    base = OmegaConf.to_container(base, resolve=False)
    full = OmegaConf.to_container(config, resolve=False)
    problems = []
    for line, key in added:
        parts = key.split(".")
        if parts[0] in CHECKED_WHERE_READ:
            continue
        node, full_node, depth = base, full, 0  # the deepest node of base on the key's path
        while depth < len(parts) and isinstance(node, dict) and parts[depth] in node:
            node, full_node = node[parts[depth]], full_node[parts[depth]]
            depth += 1
        if depth == len(parts):
            continue  # ++ on a key that exists: a plain override
        here = ".".join(parts[:depth])
        prefix = f"{here}." if here else ""
        siblings = (
            [f"{prefix}{k}" for k in node if not str(k).startswith("_")]
            if isinstance(node, dict)
            else []
        )
        if isinstance(full_node, dict) and isinstance(full_node.get("_target_"), str):
            if _parameters(full_node["_target_"]) is not None:
                continue  # its target's signature judges it (unread_constructor_keys)
            # A target that takes any keyword (**kwargs, e.g. WandbLogger) passes it on to
            # code we cannot see, which may keep it unread: only its file's keys are known.
        elif isinstance(full_node, dict):
            child = full_node.get(parts[depth])
            if isinstance(child, dict) and "_target_" in child:
                continue  # a new entry with a target of its own (a callback, a logger)
        near = closest_name(key, siblings) or closest_name(key, _paths(base))
        problems.append(
            f"{line} sets {key}, which no code reads"
            + (
                f" (closest: {near})"
                if near
                else f"; {here or 'the config'} has: "
                + ", ".join(k.removeprefix(prefix) for k in siblings)
            )
        )
    return problems


def _check_model(config: DictConfig) -> None:
    """A training config's network built on the meta device, as training does before the
    data (:func:`~multihead.model.check_model_config`): the model refuses the heads' keys that
    neither the layer nor the design takes, and every other bad model value, by name."""
    if "model" not in config or "attention" not in config:
        return
    try:
        part = {k: OmegaConf.to_container(config[k], resolve=True) for k in ("model", "attention")}
    except OmegaConfBaseException:
        return  # a value only the run can resolve: training checks the model itself
    from multihead.model import check_model_config

    check_model_config(part)


def check_config_keys(config: DictConfig) -> None:
    """Refuse a config with a key that no code would read: an added key that nothing reads
    (:func:`unread_added_keys`), a constructor's unknown one (:func:`unread_constructor_keys`)
    or one of the heads that the model does not take (:func:`_check_model`).

    Raises:
        ValueError: naming each such key and the closest real one, in one line; or what
            building the model on the meta device raises.
    """
    problems = unread_added_keys(config) if "hydra" in config else []
    task = {k: v for k, v in OmegaConf.to_container(config, resolve=False).items()
            if k != "hydra"}  # fmt: skip
    problems += unread_constructor_keys(task)
    if problems:
        raise ValueError("; ".join(problems))
    _check_model(config)


class RefuseUnreadKeys(Callback):
    """The Hydra callback of every script's config (``hydra.callbacks.refuse_unread_keys``):
    :func:`check_config_keys` on the composed config before the run (or the sweep) starts,
    so that a refused command writes nothing, not even its run directory's ``.hydra`` (a
    bad model value, ``model.d_model=0``, is refused there too)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config)

    @staticmethod
    def _check(config: DictConfig) -> None:
        # Hydra turns a callback's exceptions into warnings: this one exits itself.
        try:
            check_config_keys(config)
        except USER_ERRORS as err:
            exit_with(err)
