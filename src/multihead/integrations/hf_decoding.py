"""The old path of :mod:`multihead.integrations.huggingface.decoding`, kept for imports."""

from multihead.integrations.huggingface.decoding import (  # noqa: F401
    AppendCache,
    AppendLayer,
    prepare_for_decoding,
    spare_room,
)
