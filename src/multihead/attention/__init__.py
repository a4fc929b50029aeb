"""The reusable attention layer. Imports torch only (no Lightning, no Hydra).

Built in floors, each importing only those below it (``docs/reuse.md`` names the files):
kernels and plumbing, the parts, the head designs, the layer, functions over layers.
"""

from multihead.attention.alibi import ALiBi
from multihead.attention.backends import (
    BACKENDS,
    Backend,
    BackendUnavailableError,
    Reroute,
    attend,
    available_backends,
    backend_rules,
    register_backend,
)
from multihead.attention.convert import (
    expand_latent,
    prune_heads,
    with_kv_heads,
    with_kv_latent,
)
from multihead.attention.designs import (
    DESIGNS,
    Call,
    DesignBackendError,
    HeadDesign,
    register_design,
)
from multihead.attention.kv_cache import CacheLayout, KVCache
from multihead.attention.layer import MultiHeadAttention
from multihead.attention.masks import AttentionMask, build_attention_mask
from multihead.attention.positional import PositionalPart
from multihead.attention.projection import QKVProjection
from multihead.attention.rotary import RotaryPositions
from multihead.attention.torch_swap import (
    TorchAttentionAdapter,
    from_torch,
    replace_torch_attention,
    restore_torch_attention,
)
