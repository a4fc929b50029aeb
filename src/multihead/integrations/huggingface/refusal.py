"""The models whose attention never reaches HF's ``AttentionInterface``: the rule that finds
them (:func:`own_attention`, read from the source) and the one-line refusal they get."""

from __future__ import annotations

import inspect
import re
import sys
from functools import cache

from torch import nn
from transformers import PreTrainedModel

from multihead.integrations.huggingface.registry import FAMILIES


def routes_through_interface(model_class: type) -> bool:
    """Whether every attention ``model_class`` builds reaches HF's ``AttentionInterface``, or
    computes the same under any implementation name: :func:`own_attention` finds none."""
    return not own_attention(model_class)


@cache
def own_attention(model_class: type) -> tuple[str, ...]:
    """The attention classes ``model_class`` builds that compute their attention in their own
    code and would read, or fail on, a :func:`register` name: ``()`` for a model that may
    take one.

    HF accepts any registered name for any model. An attention module that calls its own
    eager code (Bloom, XGLM, GIT's text attention, ...) never calls the registered function:
    it reads the mask :func:`multihead_mask` built (``None`` for plain causality) as an
    additive bias, so causality is lost in silence; others index a dict of their own by the
    name (Falcon, GPT-Neo, GIT: ``KeyError``) or fail later (MPT).

    The rule, read from the source once per class, before any weight is built: an
    ``nn.Module`` class with ``Attention`` in its name, among those ``model_class`` builds
    (named in its ``__init__``, or a base's, directly or in a dict, and so on down), that
    does not look the function up (``ALL_ATTENTION_FUNCTIONS.get_interface(``) is refused if
    it reads ``_attn_implementation``, or if it computes a softmax itself over a mask it is
    given (a ``forward`` argument named ``*mask*``). An attention that takes no mask and
    reads no name (GOT-OCR2's vision windows) computes what it computes under ``eager``, as
    under ``sdpa``; a wrapper that passes the mask on to its own attention module (BERT's)
    or a linear attention without softmax (RWKV, Mamba-style hybrids) is not refused either.
    A sub-model built through the auto classes (a multimodal model's language model) is
    checked when it is built. The rule reads the installed release, so it follows HF as
    families move to the interface (Falcon did in 5.25). Exact on every small-buildable causal
    LM of transformers 5.24 and 5.25 (``tests/integrations/test_hf_sweep.py``, which counts
    the calls of the attention function, and checks the refusals against a probe that sets
    the name behind HF's back). HF's own test
    (``PreTrainedModel._can_set_attn_implementation``) reads the whole file: GIT's vision
    attention dispatches, its text attention does not. A source
    that cannot be read (a class defined in a notebook) is refused.
    """
    try:
        inspect.getsource(model_class)
    except (OSError, TypeError):
        return (model_class.__name__,)
    return tuple(sorted(c.__name__ for c in _built_classes(model_class) if _computes_its_own(c)))


@cache
def _sources(cls: type) -> tuple[tuple[type, str], ...]:
    """``cls`` and its bases up to HF's and torch's own classes, each with its source."""
    out = []
    for base in cls.__mro__:
        if not issubclass(base, nn.Module) or base.__module__.split(".")[0] == "torch":
            continue
        if base in PreTrainedModel.__mro__:
            continue
        try:
            out.append((base, inspect.getsource(base)))
        except (OSError, TypeError):
            out.append((base, ""))
    return tuple(out)


def _built_classes(model_class: type) -> set[type]:
    """The ``nn.Module`` classes named in ``model_class``'s ``__init__`` (or its bases'),
    resolved in their module, a dict's values included (GIT's classes by name), and so on
    down."""
    seen, todo = set(), [model_class]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        for base, _ in _sources(cls):
            if "__init__" not in vars(base):
                continue
            try:
                init = inspect.getsource(vars(base)["__init__"])
            except (OSError, TypeError):
                continue
            names = vars(sys.modules[base.__module__])
            for word in set(re.findall(r"\b[A-Za-z_]\w*", init)):
                value = names.get(word)
                for found in value.values() if isinstance(value, dict) else [value]:
                    if isinstance(found, type) and issubclass(found, nn.Module):
                        todo.append(found)
    return seen


def _computes_its_own(cls: type) -> bool:
    """Whether ``cls`` is an attention module that computes its attention in its own code
    over the name's mask, or reads the name (:func:`own_attention`'s rule)."""
    if "Attention" not in cls.__name__:
        return False
    sources = _sources(cls)
    source = "".join(text for _, text in sources)
    if not all(text for _, text in sources):
        return True
    if "ALL_ATTENTION_FUNCTIONS.get_interface(" in source:
        return False
    if "_attn_implementation" in source:
        return True
    masked = any("mask" in p for p in inspect.signature(cls.forward).parameters)
    return masked and re.search(r"softmax\(|logsumexp\(", source) is not None


def refusal(model_class: type, name: str) -> str:
    """The one-line reason a ``model_class`` built with ``attn_implementation=name`` is
    refused, pointing to :func:`replace_hf_attention` where a registered family
    (:data:`~multihead.integrations.huggingface.registry.FAMILIES`) covers the model."""
    swappable = sorted(c.__name__ for c in FAMILIES if c.__module__ == model_class.__module__)
    if swappable:
        fix = (
            "build it with attn_implementation='eager' and call replace_hf_attention(model) "
            f"({', '.join(swappable)} supported)"
        )
    else:
        fix = "use attn_implementation='eager'; replace_hf_attention supports " + ", ".join(
            c.__name__ for c in FAMILIES
        )
    classes = own_attention(model_class)
    where = f" ({', '.join(classes)})" if classes else ""
    return (
        f"{model_class.__name__} computes its attention in its own code{where}, not through "
        f"transformers' AttentionInterface, so attn_implementation={name!r} would not reach "
        f"the multihead kernels; {fix}"
    )
