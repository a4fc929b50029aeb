"""Deprecated (issue 49), removed in the next release: ``gate_heads`` is
:func:`~multihead.attention.steps.scale_heads`; "gate" now names the sparse heads' router."""

import warnings

from multihead.attention.steps import scale_heads as gate_heads

__all__ = ["gate_heads"]
warnings.warn(
    "multihead.attention.gate is deprecated: use multihead.attention.steps.scale_heads",
    DeprecationWarning,
    stacklevel=2,
)
