"""Attention kernels: one registry, one signature.

Every backend is a :class:`Backend` in :data:`BACKENDS`: a kernel
``kernel(q, k, v, mask, dropout_p, scale) -> out`` (``q`` ``(B, H, L, D)``; ``k``, ``v``
``(B, G, S, D)``, ``G`` dividing ``H``, never repeated in memory by the layer; ``mask`` an
:class:`~multihead.attention.masks.AttentionMask`; ``out`` ``(B, H, L, D)``) and, beside
it, every rule about it. Every list of backends (``available_backends``, the configs' and
the Transformer's checks) is read from :data:`BACKENDS`: adding one is one
:func:`register_backend` call (``docs/reuse.md``, "Adding a backend").

Under ``torch.compile(fullgraph=True)`` on the CPU the layer with ``math``, ``sdpa`` or
``flash`` compiles to one graph, and with ``math`` or ``sdpa`` it exports
(``tests/attention/test_compile.py``); ``flex`` and ``flash_attn`` say what stops them;
``efficient`` and ``cudnn`` need CUDA and were not compiled here.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask

from multihead.attention.masks import AttentionMask, apply_mask

Kernel = Callable[[Tensor, Tensor, Tensor, AttentionMask, float, float], Tensor]


class BackendUnavailableError(RuntimeError):
    """The named attention backend cannot run here, or cannot run these inputs."""


# --------------------------------------------------------------------------- math
def math_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, dropout_p: float, scale: float, *,
    on_logits: Callable[[Tensor], Tensor] | None = None,
    on_weights: Callable[[Tensor, Tensor, AttentionMask], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The textbook formula, softmax(Q K^T * scale + mask) V, written out, and its weights
    ``(B, H, L, S)`` (the ``math`` backend keeps the first).

    Two hooks let a design change the formula without copying it (talking heads):
    ``on_logits(scores)`` on the unmasked scores ``(B, H, L, S)``, and
    ``on_weights(weights, masked_scores, mask)`` on the weights before dropout.
    """
    B, H, L, D = q.shape
    G, S = k.shape[1], k.shape[2]
    # Group the query heads that share a K/V head, so K/V broadcast instead of being copied.
    qg = q.view(B, G, H // G, L, D)  # (B, G, H/G, L, D)
    scores = ((qg @ k.unsqueeze(2).transpose(-2, -1)) * scale).view(B, H, L, S)
    if on_logits is not None:
        scores = on_logits(scores)
    scores = apply_mask(scores, mask)
    weights = softmax(scores).to(q.dtype)  # (B, H, L, S)
    if on_weights is not None:
        weights = on_weights(weights, scores, mask)
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    out = dropped.view(B, G, H // G, L, S) @ v.unsqueeze(2)  # (B, G, H/G, L, D)
    return out.view(B, H, L, D), weights


def softmax(scores: Tensor) -> Tensor:
    """Softmax over the last dimension in at least fp32: under autocast the scores may be
    bf16/fp16; fp64 stays fp64."""
    return torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)


# --------------------------------------------------------------------------- SDPA
def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, dropout_p: float, scale: float
) -> Tensor:
    """``F.scaled_dot_product_attention``; PyTorch picks the kernel.

    One query with grouped K/V heads (a decoding step of GQA or MQA) is folded first
    (:func:`fold_query_heads`)."""
    # Under torch.compile with dynamic shapes these comparisons of sizes are SymBools, which
    # SDPA refuses and bool() leaves symbolic; a branch makes them Python bools (guarded).
    is_causal = True if mask.kernel_causal(q.shape[2], k.shape[2]) else False
    grouped = True if k.shape[1] != q.shape[1] else False
    if grouped and q.shape[2] == 1 and not is_causal:
        B, H, _, D = q.shape
        q_rows, mask_rows = fold_query_heads(q, mask.tensor, k.shape[1])
        out = F.scaled_dot_product_attention(
            q_rows, k, v, attn_mask=mask_rows, dropout_p=dropout_p, scale=scale
        )  # (B, G, H/G, D)
        return out.view(B, H, 1, D)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.tensor, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=grouped,
    )  # fmt: skip


def fold_query_heads(
    q: Tensor, mask: Tensor | None, num_kv_heads: int
) -> tuple[Tensor, Tensor | None]:
    """One query per head ``(B, H, 1, D)`` as ``H/G`` query rows per K/V head
    ``(B, G, H/G, D)``, and its mask (broadcastable to ``(B, H, 1, S)``) to match.

    Why: with a single query, SDPA's CPU kernel computes each query head on its own, a
    matrix-vector product that reads the group's K and V once per query head. As rows of one
    query block, the ``H/G`` heads of a group read them once: MQA's step reads the cache once
    instead of ``H`` times (2.6x faster at 4,096 keys, batch 8, on 2 CPU cores;
    docs/benchmarks.md, "Long-context decoding"). Exact: the heads of a group see the same
    keys, and each row is softmaxed on its own.
    """
    B, H, _, D = q.shape
    G = num_kv_heads
    rows = q.reshape(B, G, H // G, D)  # (B, G, H/G, D): a copy only if q is strided
    if mask is None:
        return rows, None
    mask = mask[(None,) * (4 - mask.dim())]  # (b, h, 1, s), b in (1, B), h in (1, H)
    if mask.shape[1] == 1:
        return rows, mask  # (b, 1, 1, s) broadcasts over (B, G, H/G, S)
    return rows, mask.reshape(mask.shape[0], G, H // G, mask.shape[-1])  # (b, G, H/G, s)


def expand_kv(t: Tensor, num_heads: int) -> Tensor:
    """``(B, G, S, D)`` -> ``(B, H, S, D)`` for kernels without grouped heads.

    With one K/V head (MQA) this is a stride-0 view; otherwise each head is repeated for
    its group (a copy, as ``repeat_interleave`` must).
    """
    B, G, S, D = t.shape
    if G == num_heads:
        return t
    if G == 1:
        return t.expand(B, num_heads, S, D)
    return t.repeat_interleave(num_heads // G, dim=1)


def _refused(
    name: str, kernel: str, q: Tensor, mask: AttentionMask, dropout_p: float, err: Exception
) -> BackendUnavailableError:
    """The error for a kernel's own refusal of these inputs, naming the backends that run."""
    mask_kind = "none" if mask.tensor is None else f"{mask.tensor.dtype} tensor"
    return BackendUnavailableError(
        f"backend {name!r} ({kernel}) cannot run these inputs: "
        f"device={q.device.type}, dtype={q.dtype}, head_dim={q.shape[-1]}, "
        f"mask={mask_kind}, dropout={dropout_p}. It says: "
        f"{str(err).splitlines()[0]} Other backends that run on {q.device.type}/"
        f"{q.dtype}: {', '.join(_others(name, q.device, q.dtype))}"
    )


# --------------------------------------------------------------------------- FlexAttention
_compiled_flex: Callable | None = None


def flex_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, dropout_p: float, scale: float
) -> Tensor:
    """FlexAttention: compiled on CUDA; eager elsewhere (unfused, forward only).

    Under ``torch.compile(fullgraph=True)`` on the CPU (torch 2.13) inductor fails to lower
    it with a boolean mask such as a ``key_padding_mask`` (``LoweringException``); unmasked
    and causal calls compile. Not tried inside a compiled model on CUDA.
    """
    from torch.nn.attention import flex_attention as flex

    global _compiled_flex
    if (
        q.device.type != "cuda"
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
    ):
        # PyTorch's FlexAttention has no backward off CUDA: forward (inference) only here.
        raise BackendUnavailableError(
            f"backend 'flex' has no backward on {q.device.type} (inference only there); "
            f"for training use one of {', '.join(_others('flex', q.device, q.dtype))}"
        )
    B, H, L, _ = q.shape
    S = k.shape[2]
    score_mod = block_mask = None
    if mask.kernel_causal(L, S):
        block_mask = _causal_block_mask(L, S, q.device)
    elif mask.tensor is not None and mask.tensor.dtype == torch.bool:
        # A keep mask (padding, causal, a bool attn_mask) becomes a block mask, so blocks of
        # masked keys (a short sentence's padding) are skipped, not computed and discarded.
        m = mask.tensor[(None,) * (4 - mask.tensor.dim())]  # (b, h, l, s), each full or 1
        b_, h_ = (m.shape[0] if m.shape[0] > 1 else None), (m.shape[1] if m.shape[1] > 1 else None)
        m = m.expand(B, H, L, S)

        def mask_mod(b, h, q_idx, kv_idx):
            return m[b, h, q_idx, kv_idx]

        block_mask = create_block_mask(mask_mod, b_, h_, L, S, device=q.device)
    elif mask.tensor is not None:
        m = mask.tensor.expand(B, H, L, S)  # a float bias, indexed where each score is

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + m[b, h, q_idx, kv_idx]

    fn = flex.flex_attention
    if q.is_cuda:
        if _compiled_flex is None:
            # Token-bucket batches change L and S from step to step: compiled for dynamic
            # shapes once, rather than recompiled per shape until torch gives up on it.
            _compiled_flex = torch.compile(flex.flex_attention, dynamic=True)
        fn = _compiled_flex
    grouped = k.shape[1] != q.shape[1]
    return fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=grouped)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@functools.lru_cache(maxsize=32)
def _causal_block_mask(q_len: int, kv_len: int, device: torch.device):
    """FlexAttention's causal block mask, built once per shape (building it costs a kernel)."""
    return create_block_mask(_causal, None, None, q_len, kv_len, device=device)


# --------------------------------------------------------------------------- flash-attn
def flash_attn_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, dropout_p: float, scale: float
) -> Tensor:
    """The flash-attn package; padded keys go through its varlen kernel.

    With a ``key_padding_mask`` it reads the longest key length back to the host for the
    kernel's grid (``int(seqlens_k.max())``): a graph break under ``torch.compile``, so
    ``fullgraph=True`` fails there. (From the code: flash-attn needs CUDA, not tried here.)
    """
    if mask.has_attn_mask:
        raise BackendUnavailableError(
            "backend 'flash_attn' takes key_padding_mask and is_causal only, not an "
            f"arbitrary attn_mask; backends that take one on {q.device.type}/{q.dtype}: "
            + ", ".join(
                n for n in _others("flash_attn", q.device, q.dtype) if BACKENDS[n].attn_mask
            )
        )
    B, H, L, D = q.shape
    causal = mask.is_causal and L > 1  # a single newest query sees every key
    if causal and mask.key_padding_mask is not None:
        # flash-attn aligns its causal mask to the end of each sequence's *kept* keys; with
        # padded keys dropped that shifts the rows (query i would see fewer keys than i).
        raise BackendUnavailableError(
            "backend 'flash_attn' cannot combine is_causal with a key_padding_mask over more "
            "than one query (its causal mask aligns to the unpadded length); right-padded "
            "causal self-attention needs no padding mask, or use one of "
            + ", ".join(_others("flash_attn", q.device, q.dtype))
        )
    import flash_attn

    # flash-attn wants (B, L, H, D); the layer's (B, H, L, D) are transposed views of that.
    q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))
    try:
        if mask.key_padding_mask is None:
            # Causal with L < S: flash-attn aligns bottom-right, as the layer's convention.
            out = flash_attn.flash_attn_func(
                q_, k_, v_, dropout_p=dropout_p, softmax_scale=scale, causal=causal
            )
            return out.transpose(1, 2)
        keep = ~mask.key_padding_mask  # (B, S)
        seqlens_k = keep.sum(dim=1, dtype=torch.int32)  # (B,)
        cu_k = F.pad(seqlens_k.cumsum(0, dtype=torch.int32), (1, 0))  # (B + 1,)
        cu_q = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device=q.device)  # (B + 1,)
        out = flash_attn.flash_attn_varlen_func(
            q_.reshape(B * L, H, D),
            k_[keep],  # (total_k, G, D): padded keys dropped
            v_[keep],
            cu_q,
            cu_k,
            L,
            int(seqlens_k.max()),  # the kernel's grid size: read back to the host
            dropout_p=dropout_p,
            softmax_scale=scale,
            causal=False,
        )
    except RuntimeError as err:
        raise _refused("flash_attn", "flash-attn", q, mask, dropout_p, err) from err
    return out.view(B, L, H, D).transpose(1, 2)


# --------------------------------------------------------------------------- registry
Rule = Callable[..., "str | None"]
HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Reroute:
    """Inputs a backend hands to ``to``, those where ``when(q, k)``: a declared rule (``why``
    in words), listed by :func:`backend_rules` and in run summaries, never a silent one."""

    when: Callable[[Tensor, Tensor], bool]
    to: str
    why: str


@dataclass(frozen=True)
class Backend:
    """One attention backend, called as its kernel with its reroute applied.

    Attributes:
        name, kernel: the name layers and configs use; the kernel (module docstring).
        available: ``available(device, dtype, head_dim)``: why it cannot run there, or
            ``None`` (``head_dim`` is ``None`` while not known).
        dropout_rule: ``dropout_rule(p)``: why it cannot apply attention dropout ``p``.
        package: the pip package it needs (imported with ``_`` for ``-``), if any.
        attn_mask, padding_mask: it takes an ``attn_mask``, a ``key_padding_mask``.
        score_bias: it takes a positional part's score bias (ALiBi): the additive mask,
            or ``score_mod`` for ``flex``; a layer refuses the others by name.
        reroute: inputs it hands to another backend.
    """

    name: str
    kernel: Kernel
    available: Rule = lambda device, dtype, head_dim: None  # noqa: E731
    dropout_rule: Rule = lambda p: None  # noqa: E731
    package: str | None = None
    attn_mask: bool = True
    padding_mask: bool = True
    score_bias: bool = True
    reroute: Reroute | None = None

    def __call__(self, q, k, v, mask: AttentionMask, dropout_p: float, scale: float) -> Tensor:
        # Checked at every call with dropout, not only by attend: a kernel without dropout
        # (flex) would otherwise ignore it when called from the registry directly.
        if dropout_p and (reason := self.dropout_rule(dropout_p)) is not None:
            raise BackendUnavailableError(reason)
        if self.reroute is not None and self.reroute.when(q, k):
            return BACKENDS[self.reroute.to](q, k, v, mask, dropout_p, scale)
        return self.kernel(q, k, v, mask, dropout_p, scale)


BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    """Add ``backend`` to :data:`BACKENDS`, replacing one of its name."""
    BACKENDS[backend.name] = backend
    return backend


def runs_on(what: str, **dtypes: tuple[torch.dtype, ...] | None) -> Rule:
    """The ``available`` rule of a kernel that runs on the device types named, each with the
    dtypes given (``None``: any), e.g. ``runs_on("flash-attn", cuda=HALF)``."""

    def rule(device: torch.device, dtype: torch.dtype, head_dim: int | None) -> str | None:
        allowed = dtypes.get(device.type, ())
        if device.type in dtypes and (allowed is None or dtype in allowed):
            return None
        where = " or ".join(d.upper() + (" in fp16/bf16" if t else "") for d, t in dtypes.items())
        return f"{what} runs on {where} only (got {device.type}/{dtype})"

    return rule


def _flex_rule(device: torch.device, dtype: torch.dtype, head_dim: int | None) -> str | None:
    # torch 2.13's inductor: "NYI: embedding dimension of the query, key, and value must be
    # at least 16".
    if device.type == "cuda" and head_dim is not None and head_dim < 16:
        return f"FlexAttention on CUDA needs head_dim >= 16 (got head_dim={head_dim})"
    return None


def _pinned(name: str, kernel: SDPBackend, available: Rule, **rules) -> Backend:
    """SDPA pinned to one kernel with ``sdpa_kernel``, as backend ``name``."""
    grouped = kernel != SDPBackend.EFFICIENT_ATTENTION  # takes grouped K/V heads (enable_gqa)

    def attention(q, k, v, mask: AttentionMask, dropout_p: float, scale: float) -> Tensor:
        if not grouped:
            k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        try:
            with sdpa_kernel([kernel]):
                return sdpa_attention(q, k, v, mask, dropout_p, scale)
        except RuntimeError as err:
            raise _refused(name, f"SDPA pinned to {kernel.name}", q, mask, dropout_p, err) from err

    return Backend(name, attention, available, **rules)


for _backend in (
    Backend("math", lambda *inputs: math_attention(*inputs)[0]),
    Backend("sdpa", sdpa_attention),
    # SDPA's flash kernel takes no mask on CUDA.
    _pinned(
        "flash",
        SDPBackend.FLASH_ATTENTION,
        runs_on("SDPA's flash kernel", cpu=None, cuda=HALF),
        attn_mask=False,
        padding_mask=False,
        score_bias=False,
    ),
    _pinned(
        "efficient", SDPBackend.EFFICIENT_ATTENTION, runs_on("SDPA's efficient kernel", cuda=None)
    ),
    _pinned(
        "cudnn",
        SDPBackend.CUDNN_ATTENTION,
        runs_on("SDPA's cuDNN kernel", cuda=HALF),
        dropout_rule=lambda p: (
            None
            if (p * 16).is_integer()
            else f"SDPA's cuDNN kernel takes dropout in multiples of 1/16 only (got dropout={p})"
        ),
        attn_mask=False,
        score_bias=False,
        # torch 2.13's sdp_utils refuses a length of 1: each decoding step's one query, the
        # first step's one key; such a call is one row (or column) of scores.
        reroute=Reroute(
            lambda q, k: 1 in (q.shape[2], k.shape[2]),
            "math",
            "a query or key length of 1 (each decoding step) runs on 'math': cuDNN refuses it",
        ),
    ),
    Backend(
        "flex",
        flex_attention,
        _flex_rule,
        lambda p: f"backend 'flex' takes no attention dropout (got dropout={p})" if p else None,
    ),
    Backend(
        "flash_attn",
        flash_attn_attention,
        runs_on("flash-attn", cuda=HALF),
        package="flash-attn",
        attn_mask=False,
        score_bias=False,
    ),
):
    register_backend(_backend)


def _others(name: str, device: torch.device, dtype: torch.dtype) -> list[str]:
    return [n for n in available_backends(device, dtype) if n != name]


def unavailable_reason(
    name: str, device: torch.device | None = None, dtype: torch.dtype | None = None, *,
    dropout: float = 0.0, head_dim: int | None = None,
) -> str | None:  # fmt: skip
    """Why backend ``name`` cannot run with ``dropout`` and ``head_dim`` on ``device`` in
    ``dtype``, or ``None``, by its registry entry. ``device=None`` checks only what holds
    everywhere: the name, the package and the dropout."""
    backend = BACKENDS.get(name)
    if backend is None:
        return f"unknown backend {name!r}"
    rule = backend.dropout_rule(dropout)
    if rule is not None:
        return rule
    package = backend.package
    if package is not None and importlib.util.find_spec(package.replace("-", "_")) is None:
        return f"the {package} package is not installed (pip install {package})"
    return None if device is None else backend.available(device, dtype, head_dim)


def available_backends(
    device: torch.device | str, dtype: torch.dtype, *, dropout: float = 0.0
) -> list[str]:
    """The registered backends that can run on ``device`` with ``dtype`` and ``dropout``
    (some reroute some inputs: :func:`backend_rules`)."""
    device = torch.device(device)
    return [n for n in BACKENDS if unavailable_reason(n, device, dtype, dropout=dropout) is None]


def backend_rules() -> dict[str, str]:
    """The declared reroutes, ``{name: rule in words}``, for the backends that have one."""
    return {n: b.reroute.why for n, b in BACKENDS.items() if b.reroute is not None}


def check_backend(
    name: str, device: torch.device | None, dtype: torch.dtype, *, dropout: float = 0.0,
    head_dim: int | None = None,
) -> None:  # fmt: skip
    """Raise if backend ``name`` cannot run, by :func:`unavailable_reason`: the layer
    calls it when built (``device=None``: its parameters may still move) and on its first
    call on each device and dtype. The kernels raise only for what depends on the inputs.

    Raises:
        ValueError: an unknown name, or a setting the backend lacks (dropout).
        BackendUnavailableError: what this machine lacks (a package, the device or dtype).
    """
    here = torch.device("cpu") if device is None else device
    reason = unavailable_reason(name, device, dtype, dropout=dropout, head_dim=head_dim)
    if reason is None:
        return
    runnable = available_backends(here, dtype, dropout=dropout)
    setting = name not in BACKENDS or BACKENDS[name].dropout_rule(dropout) is not None
    raise (ValueError if setting else BackendUnavailableError)(
        f"attention backend {name!r} cannot run on {here.type}/{dtype}: {reason}. Registered: "
        f"{', '.join(BACKENDS)}; these can run here with dropout={dropout}: {', '.join(runnable)}"
    )


def default_scale(head_dim: int) -> float:
    """The 1/sqrt(D) of "scaled" dot-product attention."""
    return 1.0 / math.sqrt(head_dim)


@functools.cache
def _check_once(
    name: str, device: torch.device, dtype: torch.dtype, dropout: float, head_dim: int
) -> None:
    """:func:`check_backend`, once per kind of input (it lists the backends that can run,
    for its message: 0.2 ms); one that raises is checked again. While tracing, torch.compile
    ignores the cache and checks each time (Python only): a cache read there would become a
    guard of the compiled code, and a later addition to it a recompilation."""
    check_backend(name, device, dtype, dropout=dropout, head_dim=head_dim)


def attend(
    q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, *, backend: str, dropout_p: float,
    scale: float, need_weights: bool = False, on_logits: Callable | None = None,
    on_weights: Callable | None = None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """softmax(Q K^T * scale + mask) V ``(B, H, L, D)`` by ``backend``, or by the math path
    with the weights ``(B, H, L, S)`` when they are asked for or a hook (``on_logits``,
    ``on_weights`` of :func:`math_attention`) is given: the one call every
    head design makes (HF's attention-function arguments: q, k, v, mask, scale, dropout).
    Query rows with no key to attend to come out as zeros."""
    if need_weights or on_logits is not None or on_weights is not None:
        hooks = dict(on_logits=on_logits, on_weights=on_weights)
        out, weights = math_attention(q, k, v, mask, dropout_p, scale, **hooks)
    else:
        _check_once(backend, q.device, q.dtype, dropout_p, q.shape[-1])
        out, weights = BACKENDS[backend](q, k, v, mask, dropout_p, scale), None
    if mask.empty_rows is not None:
        # Rows with no key to attend to: zeros, not the mean of unmasked values.
        out = out.masked_fill(mask.empty_rows, 0.0)
        if weights is not None:
            weights = weights.masked_fill(mask.empty_rows, 0.0)
    return out, weights
