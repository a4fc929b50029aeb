"""The model families :func:`~multihead.integrations.huggingface.replace_hf_attention`
converts, by HF attention class.

A family is one file: its converter (an HF attention module and a backend in, an
:class:`~multihead.integrations.huggingface.adapter.HFAttentionAdapter` with the same weights
and its save map, an ``HFLayout``, out) and one :func:`register_family` call. The package's
own are in ``families/``; a user's module registers its own the same way, once imported
(``tests/integrations/test_hf_family_plugin.py``, ``docs/reuse.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Family:
    """How one HF attention class is swapped.

    Attributes:
        convert: ``convert(module, backend) -> adapter``: the module's weights in an
            ``HFAttentionAdapter`` (or a subclass, for a call of another shape), or
            ``ValueError`` naming what the layer does not compute.
        check_model: ``check_model(model)``, run once on a model with a module of this
            family after every module is converted and before any is replaced: ``ValueError``
            for what the converter cannot see from the module alone (DeepSeek: the model's
            rotary module). ``None``: none.
    """

    convert: Callable[[nn.Module, str], nn.Module]
    check_model: Callable[[nn.Module], None] | None = None


# By exact type: a subclass may change forward. In registration order, which the swap's
# and the refusals' messages list.
FAMILIES: dict[type, Family] = {}


def register_family(
    *attention_classes: type,
    convert: Callable[[nn.Module, str], nn.Module],
    check_model: Callable[[nn.Module], None] | None = None,
) -> None:
    """From now on :func:`~multihead.integrations.huggingface.replace_hf_attention` swaps
    every module of exactly these classes with ``convert`` (:class:`Family`), replacing one
    registered for a class before.

    Raises:
        TypeError: no class, something that is not an ``nn.Module`` class, or a ``convert``
            that is not callable.
    """
    bad = [c for c in attention_classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if not attention_classes or bad:
        got = repr(bad[0]) if bad else "none"
        raise TypeError(f"register_family needs HF attention classes (nn.Module), got {got}")
    if not callable(convert):
        raise TypeError(f"register_family: convert must be callable, got {convert!r}")
    for cls in attention_classes:
        FAMILIES[cls] = Family(convert, check_model)
