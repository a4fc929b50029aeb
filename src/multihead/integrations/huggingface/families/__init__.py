"""The families the package swaps, one file each: a converter, its save map and one
:func:`~multihead.integrations.huggingface.registry.register_family` call. Imported here, in
the order the swap's messages list them; a family of the user's is registered by the user's
own module, the same way (``docs/reuse.md``)."""

# isort: off
from multihead.integrations.huggingface.families import gpt2, llama, bloom, diffllama, deepseek
# isort: on

__all__ = ["gpt2", "llama", "bloom", "diffllama", "deepseek"]
