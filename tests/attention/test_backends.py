"""Every backend against the written-out math path: outputs and gradients."""

import importlib.machinery
import importlib.util

import pytest
import torch

from multihead import BackendUnavailableError, MultiHeadAttention
from multihead.attention import available_backends
from multihead.attention.backends import BACKENDS, unavailable_reason
from multihead.attention.masks import AttentionMask, build_attention_mask

E, H = 64, 4  # head_dim 16: the smallest FlexAttention compiles on CUDA
B, L = 2, 6
CPU_BACKENDS = available_backends("cpu", torch.float32)
CUDA = torch.cuda.is_available()
KV_HEADS = {"mha": None, "gqa": 2, "mqa": 1}


def make_masks(kind: str, batch: int = B, length: int = L) -> dict:
    """Keyword arguments for forward: one kind of mask, none fully masking a row."""
    gen = torch.Generator().manual_seed(1)
    pad = torch.zeros(batch, length, dtype=torch.bool)
    pad[1, length - 2 :] = True
    if kind == "none":
        return {}
    if kind == "padding":
        return {"key_padding_mask": pad}
    if kind == "causal":
        return {"is_causal": True}
    if kind == "causal+padding":
        return {"is_causal": True, "key_padding_mask": pad}
    if kind == "bool":
        mask = torch.rand(length, length, generator=gen) < 0.3
        mask.fill_diagonal_(False)
        return {"attn_mask": mask}
    if kind == "float":
        return {"attn_mask": torch.randn(batch, 1, length, length, generator=gen)}
    if kind == "float+padding":
        return {"attn_mask": torch.randn(length, length, generator=gen), "key_padding_mask": pad}
    raise ValueError(kind)


MASK_KINDS = ["none", "padding", "causal", "causal+padding", "bool", "float", "float+padding"]


def pair(backend: str, num_kv_heads, device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    ref = MultiHeadAttention(E, H, num_kv_heads, backend="math", device=device, dtype=dtype)
    other = MultiHeadAttention(E, H, num_kv_heads, backend=backend, device=device, dtype=dtype)
    other.load_state_dict(ref.state_dict())
    return ref, other


def run_with_grads(layer, x, memory, kwargs):
    x = x.clone().requires_grad_()
    memory = None if memory is None else memory.clone().requires_grad_()
    layer.zero_grad()
    out = layer(x, memory, **kwargs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out))
    grads = [x.grad] + ([] if memory is None else [memory.grad])
    grads += [p.grad for p in layer.parameters()]
    return out, grads


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("variant", KV_HEADS)
@pytest.mark.parametrize("backend", [b for b in CPU_BACKENDS if b not in ("math", "flex")])
def test_backend_matches_math_outputs_and_grads(backend, variant, mask_kind):
    ref, other = pair(backend, KV_HEADS[variant])
    x = torch.randn(B, L, E)
    kwargs = make_masks(mask_kind)
    out_ref, grads_ref = run_with_grads(ref, x, None, kwargs)
    out, grads = run_with_grads(other, x, None, kwargs)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-4)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", KV_HEADS)
@pytest.mark.parametrize("backend", [b for b in CPU_BACKENDS if b not in ("math", "flex")])
def test_backend_matches_math_cross_attention(backend, variant):
    ref, other = pair(backend, KV_HEADS[variant])
    x, memory = torch.randn(B, L, E), torch.randn(B, L + 3, E)
    kwargs = make_masks("padding", length=L + 3)
    out_ref, grads_ref = run_with_grads(ref, x, memory, kwargs)
    out, grads = run_with_grads(other, x, memory, kwargs)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-4)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("variant", KV_HEADS)
def test_flex_matches_math_forward_on_cpu(variant, mask_kind):
    # PyTorch's FlexAttention has no backward on CPU, so only the forward is compared here;
    # the gradient comparison runs on CUDA (test_cuda_backend_matches_math).
    ref, flex = pair("flex", KV_HEADS[variant])
    x = torch.randn(B, L, E)
    kwargs = make_masks(mask_kind)
    with torch.no_grad():
        torch.testing.assert_close(flex(x, **kwargs), ref(x, **kwargs), atol=1e-5, rtol=1e-4)


def test_flex_training_on_cpu_raises_and_lists_backends():
    layer = MultiHeadAttention(E, H, backend="flex")
    with pytest.raises(BackendUnavailableError, match=r"no backward on cpu.*math, sdpa"):
        layer(torch.randn(B, L, E))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("variant", KV_HEADS)
def test_fully_masked_rows_give_zeros_and_finite_grads(backend, variant):
    torch.manual_seed(0)
    layer = MultiHeadAttention(E, H, KV_HEADS[variant], backend=backend, bias=False)
    x = torch.randn(B, L, E, requires_grad=backend != "flex")
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[1] = True  # every key of sentence 1 is padding
    float_mask = torch.zeros(L, L)
    float_mask[2] = float("-inf")  # query row 2 sees nothing
    for kwargs in ({"key_padding_mask": pad}, {"attn_mask": float_mask}):
        with torch.set_grad_enabled(backend != "flex"):
            out = layer(x, **kwargs)
        assert not out.isnan().any()
        # Without biases an empty attention row is exactly zero after the output projection.
        empty = out[1] if "key_padding_mask" in kwargs else out[:, 2]
        assert torch.equal(empty, torch.zeros_like(empty))
        if backend != "flex":
            out.sum().backward()
            assert torch.isfinite(x.grad).all()
            assert all(torch.isfinite(p.grad).all() for p in layer.parameters())
            x.grad = None
            layer.zero_grad()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bf16_autocast_on_cpu(backend):
    torch.manual_seed(0)
    layer = MultiHeadAttention(E, H, 2, backend=backend)
    x = torch.randn(B, L, E, requires_grad=backend != "flex")
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[0] = True  # a fully masked sentence: -inf must survive bf16 without NaN
    mask = torch.zeros(L, L).masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), -1e30)
    with torch.set_grad_enabled(backend != "flex"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x, key_padding_mask=pad, attn_mask=mask)
        with torch.no_grad():
            ref = layer(x.detach(), key_padding_mask=pad, attn_mask=mask)
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, atol=5e-2, rtol=5e-2)
    if backend != "flex":
        out.float().sum().backward()
        assert torch.isfinite(x.grad).all()


def test_mask_never_uses_a_large_finite_negative():
    mask = build_attention_mask(
        key_padding_mask=torch.tensor([[False, True]]),
        attn_mask=torch.zeros(2, 2),
        is_causal=True,
        batch_size=1,
        num_heads=1,
        q_len=2,
        kv_len=2,
        dtype=torch.float16,
        device=torch.device("cpu"),
    )
    finite_negatives = mask.tensor[torch.isfinite(mask.tensor) & (mask.tensor < 0)]
    assert finite_negatives.numel() == 0
    assert torch.isneginf(mask.tensor).any()


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
@pytest.mark.skipif(CUDA, reason="checks the error raised where CUDA is missing")
def test_cuda_only_backend_on_cpu_raises_with_runnable_list(backend):
    layer = MultiHeadAttention(E, H, backend=backend)
    with pytest.raises(BackendUnavailableError, match=rf"'{backend}'.*cpu.*math, sdpa, flash"):
        layer(torch.randn(B, L, E))


def test_unknown_backend_lists_backends():
    with pytest.raises(ValueError, match=r"'nope'.*math, sdpa, flash, efficient, cudnn, flex"):
        MultiHeadAttention(E, H, backend="nope")


def test_flex_with_dropout_raises():
    with pytest.raises(ValueError, match=r"dropout=0.1.*math, sdpa"):
        MultiHeadAttention(E, H, dropout=0.1, backend="flex")
    # The registry entry called directly refuses it too: FlexAttention would ignore it.
    q = torch.randn(1, H, 3, E // H)
    with pytest.raises(BackendUnavailableError, match=r"'flex' takes no attention dropout"):
        BACKENDS["flex"](q, q, q, AttentionMask(), 0.1, 1.0)


@pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here"
)
def test_flash_attn_missing_package_raises():
    with pytest.raises(BackendUnavailableError, match=r"flash-attn.*not installed.*math, sdpa"):
        MultiHeadAttention(E, H, backend="flash_attn")


def test_flash_attn_rejects_an_arbitrary_mask_before_running():
    q = torch.randn(1, H, L, 16)
    mask = build_attention_mask(
        key_padding_mask=None,
        attn_mask=torch.zeros(L, L, dtype=torch.bool),
        is_causal=False,
        batch_size=1,
        num_heads=H,
        q_len=L,
        kv_len=L,
        dtype=q.dtype,
        device=q.device,
    )
    with pytest.raises(BackendUnavailableError, match=r"arbitrary attn_mask.*math, sdpa"):
        BACKENDS["flash_attn"](q, q, q, mask, 0.0, 1.0)


def test_available_backends_by_device_and_dtype():
    assert available_backends("cpu", torch.float32) == ["math", "sdpa", "flash", "flex"]
    cuda_fp32 = available_backends("cuda", torch.float32)
    assert "flash" not in cuda_fp32 and "cudnn" not in cuda_fp32 and "efficient" in cuda_fp32
    assert {"flash", "efficient", "cudnn"} <= set(available_backends("cuda", torch.float16))


# --------------------------------------------------------------------------- CUDA
# Compared with the math path, so math itself is not among them.
CUDA_BACKENDS = ["sdpa", "flash", "efficient", "cudnn", "flex", "flash_attn"]
NO_ARBITRARY_MASK = {"flash", "flash_attn"}


def skip_if_absent(backend: str, dtype: torch.dtype) -> None:
    """Skip when the machine lacks the backend (a package, cuDNN); never for an error it raises."""
    reason = unavailable_reason(backend, torch.device("cuda"), dtype)
    if reason is None and backend == "cudnn" and not torch.backends.cudnn.is_available():
        reason = "cuDNN is not available in this PyTorch build"
    if reason is not None:
        pytest.skip(f"backend {backend!r} is absent here: {reason}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the efficient, cudnn, flash_attn kernels)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "padding", "float"])
@pytest.mark.parametrize("variant", KV_HEADS)
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_cuda_backend_matches_math(backend, variant, mask_kind, dtype):
    skip_if_absent(backend, dtype)
    ref, other = pair(backend, KV_HEADS[variant], device="cuda", dtype=dtype)
    x = torch.randn(B, 16, E, device="cuda", dtype=dtype)
    kwargs = {
        k: v.cuda() if torch.is_tensor(v) else v for k, v in make_masks(mask_kind, B, 16).items()
    }
    if backend in NO_ARBITRARY_MASK and mask_kind in ("float", "padding"):
        if backend == "flash_attn" and mask_kind == "padding":
            pass  # flash-attn takes padding through its varlen kernel
        else:
            with pytest.raises(BackendUnavailableError, match="math"):
                other(x, **kwargs)
            return
    out, grads = run_with_grads(other, x, None, kwargs)
    out_ref, grads_ref = run_with_grads(ref, x, None, kwargs)
    tol = {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.float(), out_ref.float(), **tol)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g.float(), g_ref.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("backend", ["sdpa", "efficient", "cudnn", "flex", "math"])
def test_cuda_fully_masked_rows(backend, dtype):
    skip_if_absent(backend, dtype)
    layer = MultiHeadAttention(E, H, 2, backend=backend, bias=False, device="cuda", dtype=dtype)
    x = torch.randn(B, L, E, device="cuda", dtype=dtype, requires_grad=True)
    pad = torch.zeros(B, L, dtype=torch.bool, device="cuda")
    pad[1] = True
    out = layer(x, key_padding_mask=pad)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    out.float().sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_flash_in_fp32_on_cuda_raises():
    layer = MultiHeadAttention(E, H, backend="flash", device="cuda")
    with pytest.raises(BackendUnavailableError, match=r"'flash'.*float32.*math, sdpa, efficient"):
        layer(torch.randn(B, L, E, device="cuda"))


def test_expand_kv_is_a_view_for_mqa_and_repeats_groups_for_gqa() -> None:
    from multihead.attention.backends import expand_kv

    k = torch.randn(2, 1, 5, 4)
    mqa = expand_kv(k, 8)
    assert mqa.shape == (2, 8, 5, 4) and mqa.data_ptr() == k.data_ptr()  # no copy
    g = torch.randn(2, 2, 5, 4)
    gqa = expand_kv(g, 8)
    # Query head h uses K/V head h // (H / G), as SDPA's enable_gqa and the math path do.
    for h in range(8):
        torch.testing.assert_close(gqa[:, h], g[:, h // 4])
    assert expand_kv(g, 2) is g


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_cuda_decoding_matches_the_full_pass(backend, dtype):
    """Every backend decodes: a KV cache from one key (cuDNN refuses S = 1 on its own) up,
    and cross-attention to a padded memory (flash takes no mask: it must say so)."""
    skip_if_absent(backend, dtype)
    torch.manual_seed(0)
    layer = MultiHeadAttention(E, H, 2, backend=backend, device="cuda", dtype=dtype).eval()
    x, memory = (torch.randn(B, n, E, device="cuda", dtype=dtype) for n in (L, L + 3))
    pad = make_masks("padding", length=L + 3)["key_padding_mask"].cuda()
    with torch.no_grad():
        cache = layer.make_kv_cache(B, L)
        steps = [layer(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(L)]
        full = layer(x, is_causal=True)
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-2, rtol=2e-2)
        if backend == "flash":
            with pytest.raises(BackendUnavailableError, match="efficient"):
                layer(x, memory, key_padding_mask=pad)
            return
        cache = layer.make_kv_cache(B, L + 3)
        steps = [
            layer(x[:, t : t + 1], memory, key_padding_mask=pad, kv_cache=cache) for t in range(L)
        ]
        full = layer(x, memory, key_padding_mask=pad)
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------- rules, without a GPU
def test_flex_on_cuda_needs_head_dim_16():
    cuda = torch.device("cuda")
    assert "head_dim >= 16 (got head_dim=8)" in unavailable_reason(
        "flex", cuda, torch.bfloat16, head_dim=8
    )
    assert unavailable_reason("flex", cuda, torch.bfloat16, head_dim=16) is None
    assert unavailable_reason("flex", torch.device("cpu"), torch.float32, head_dim=8) is None


def test_cudnn_dropout_must_be_a_multiple_of_a_sixteenth():
    with pytest.raises(ValueError, match=r"multiples of 1/16.*dropout=0.1\b.*math, sdpa"):
        MultiHeadAttention(E, H, backend="cudnn", dropout=0.1)
    MultiHeadAttention(E, H, backend="cudnn", dropout=0.125)  # built; it runs on CUDA only


class FlashAttnStub:
    """flash-attn's two entry points, written from its documented semantics.

    ``flash_attn_func(q, k, v, ...)``: (B, L, H, D) tensors. ``flash_attn_varlen_func``:
    sequences packed along the first dimension, delimited by int32 ``cu_seqlens``. With
    ``causal=True`` the mask is aligned to the bottom right: query i of a sequence with
    ``seqlen_q`` queries and ``seqlen_k`` keys sees keys j <= i + seqlen_k - seqlen_q. Query
    head h reads K/V head h // (H / G).
    """

    __spec__ = importlib.machinery.ModuleSpec("flash_attn", None)  # "installed" for find_spec

    @staticmethod
    def _attend(q, k, v, scale, causal):  # (Lq, H, D), (Lk, G, D)
        H, G = q.shape[1], k.shape[1]
        k, v = (t.repeat_interleave(H // G, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if causal:
            Lq, Lk = q.shape[0], k.shape[0]
            i, j = torch.arange(Lq)[:, None], torch.arange(Lk)[None, :]
            scores = scores.masked_fill(j > i + Lk - Lq, float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)

    def flash_attn_func(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
        assert q.dim() == 4 and q.shape[2] % k.shape[2] == 0
        return torch.stack(
            [self._attend(*t, softmax_scale, causal) for t in zip(q, k, v, strict=True)]
        )

    def flash_attn_varlen_func(
        self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False
    ):
        assert cu_q.dtype == cu_k.dtype == torch.int32 and q.dim() == k.dim() == 3
        assert max_k == int((cu_k[1:] - cu_k[:-1]).max())
        out = torch.empty_like(q)
        for b in range(len(cu_q) - 1):
            rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            out[rows] = self._attend(q[rows], k[keys], v[keys], softmax_scale, causal)
        return out


@pytest.mark.parametrize(
    ("kind", "q_len"),
    [("padding", L), ("causal", L), ("causal", 2), ("causal+padding", 1), ("none", L)],
)
@pytest.mark.parametrize("variant", KV_HEADS)
def test_flash_attn_calls_match_math_by_its_documented_semantics(monkeypatch, kind, q_len, variant):
    monkeypatch.setitem(__import__("sys").modules, "flash_attn", FlashAttnStub())
    torch.manual_seed(0)
    S = L + 2
    q = torch.randn(B, H, q_len, 16)
    k, v = (torch.randn(B, H // (4 // (KV_HEADS[variant] or 4)), S, 16) for _ in range(2))
    masks = make_masks(kind, length=S)
    mask = build_attention_mask(
        key_padding_mask=masks.get("key_padding_mask"),
        attn_mask=None,
        is_causal=masks.get("is_causal", False),
        batch_size=B,
        num_heads=H,
        q_len=q_len,
        kv_len=S,
        dtype=q.dtype,
        device=q.device,
    )
    expected = BACKENDS["math"](q, k, v, mask, 0.0, 0.25)
    torch.testing.assert_close(BACKENDS["flash_attn"](q, k, v, mask, 0.0, 0.25), expected)


def test_flash_attn_refuses_causal_with_padding_over_several_queries(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "flash_attn", FlashAttnStub())
    q = torch.randn(B, H, L, 16)
    masks = make_masks("causal+padding")
    mask = build_attention_mask(
        **masks, attn_mask=None, batch_size=B, num_heads=H, q_len=L, kv_len=L,
        dtype=q.dtype, device=q.device,
    )  # fmt: skip
    with pytest.raises(BackendUnavailableError, match=r"is_causal with a key_padding_mask.*sdpa"):
        BACKENDS["flash_attn"](q, q, q, mask, 0.0, 0.25)


def test_a_kernel_refusal_is_a_backend_error(monkeypatch):
    class Refusing(FlashAttnStub):
        def flash_attn_func(self, *args, **kwargs):
            raise RuntimeError("FlashAttention only supports fp16 and bf16 data type")

    monkeypatch.setitem(__import__("sys").modules, "flash_attn", Refusing())
    q = torch.randn(B, H, L, 16)
    mask = build_attention_mask(
        key_padding_mask=None, attn_mask=None, is_causal=True, batch_size=B, num_heads=H,
        q_len=L, kv_len=L, dtype=q.dtype, device=q.device,
    )  # fmt: skip
    with pytest.raises(BackendUnavailableError, match=r"'flash_attn'.*only supports fp16.*sdpa"):
        BACKENDS["flash_attn"](q, q, q, mask, 0.0, 0.25)


class SyncCounter(__import__("torch.utils._python_dispatch", fromlist=["x"]).TorchDispatchMode):
    """Counts the ops that read a value back to the host (a sync on CUDA)."""

    SYNCS = {"_local_scalar_dense", "is_nonzero", "nonzero", "equal"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.__name__.split(".")[0] in self.SYNCS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_the_layer_never_reads_back_from_the_device(backend):
    layer = MultiHeadAttention(E, H, 2, backend=backend).eval()
    x, memory = torch.randn(B, L, E), torch.randn(B, L + 3, E)
    pad = make_masks("padding", length=L + 3)["key_padding_mask"]
    pad[0] = True  # an empty row too: the rule that zeroes it must not ask whether there is one
    layer(x)  # the first call checks the backend
    with torch.no_grad(), SyncCounter() as syncs:
        layer(x, is_causal=True)
        layer(x, memory, key_padding_mask=pad)
        layer(x, attn_mask=torch.randn(L, L))
    assert syncs.count == 0


# --------------------------------------------------------------------------- the registry
def test_cudnn_reroutes_length_one_sequences_by_a_declared_and_reported_rule():
    """cuDNN refuses a sequence of length 1 (every decoding step); such calls run on math
    by a rule of cuDNN's registry entry, listed and reported, not inside its kernel."""
    from multihead.attention import backend_rules
    from multihead.attention.masks import AttentionMask

    from helpers.models import tiny_model

    reroute = BACKENDS["cudnn"].reroute
    assert reroute.to == "math" and backend_rules() == {"cudnn": reroute.why}
    one, five = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8)
    assert reroute.when(one, five) and reroute.when(five, one) and not reroute.when(five, five)
    with pytest.raises(BackendUnavailableError, match="cudnn"):  # the kernel alone: no fallback
        BACKENDS["cudnn"].kernel(one, five, five, AttentionMask(), 0.0, 0.25)
    expected = BACKENDS["math"](one, five, five, AttentionMask(), 0.0, 0.25)
    assert torch.equal(BACKENDS["cudnn"](one, five, five, AttentionMask(), 0.0, 0.25), expected)
    model = tiny_model(attention={"num_heads": 4, "backend": "cudnn"})
    assert model.head_config["decoder_self_attention"]["backend_reroute"] == reroute.why
    assert "backend_reroute" not in tiny_model().head_config["decoder_self_attention"]


def test_a_registered_toy_backend_runs_in_the_layer_and_the_model():
    """Adding a backend is one register_backend call (docs/reuse.md, "Adding a backend")."""
    from multihead.attention import Backend, register_backend
    from multihead.attention.masks import apply_mask

    from helpers.models import tiny_model

    calls = []

    def toy_attention(q, k, v, mask, dropout_p, scale):  # MHA only (G = H), no dropout
        calls.append(tuple(q.shape))
        scores = apply_mask((q @ k.transpose(-2, -1)) * scale, mask)  # (B, H, L, S)
        return torch.softmax(scores, dim=-1) @ v

    def cpu_only(device, dtype, head_dim):
        return None if device.type == "cpu" else f"toy runs on CPU only (got {device.type})"

    register_backend(Backend("toy", toy_attention, cpu_only))
    try:
        assert "toy" in available_backends("cpu", torch.float32)
        assert "toy" not in available_backends("cuda", torch.float16)
        torch.manual_seed(0)
        layer = MultiHeadAttention(16, 4, backend="toy")
        reference = MultiHeadAttention(16, 4, backend="math")
        reference.load_state_dict(layer.state_dict())
        x, pad = torch.randn(2, 5, 16), torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
        with torch.no_grad():
            out = layer(x, x.flip(1), key_padding_mask=pad)
            expected = reference(x, x.flip(1), key_padding_mask=pad)
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
        assert calls == [(2, 4, 5, 4)]
        model = tiny_model(attention={"num_heads": 4, "backend": "toy"})
        model(torch.randint(3, 20, (2, 6)), torch.randint(3, 20, (2, 4)))
        assert model.head_config["encoder_self_attention"]["backend"] == "toy"
    finally:
        del BACKENDS["toy"]


def _fp64_reference(layer: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of an MHA layer, written out in fp64."""
    B, L, E = x.shape
    H, D = layer.num_heads, E // layer.num_heads
    q, k, v = torch.nn.functional.linear(x, layer.in_proj.weight, layer.in_proj.bias).split(E, -1)
    q, k, v = (t.view(B, L, H, D).transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) / D**0.5
    scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    heads = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(B, L, E)
    return layer.out_proj(heads)


@pytest.mark.parametrize(
    "options", [{}, {"design": "talking_heads"}], ids=["math", "talking_heads"]
)
def test_an_fp64_layer_keeps_fp64_accuracy(options):
    """The reference kernel's softmax promotes to at least fp32 and never demotes fp64."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4, backend="math", dtype=torch.float64, **options)
    with torch.no_grad():
        layer.in_proj.weight.mul_(8.0)  # sharp scores: fp32 rounding would show
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    with torch.no_grad():
        out = layer(x, is_causal=True)
        torch.testing.assert_close(out, _fp64_reference(layer, x), atol=1e-12, rtol=0)


def test_head_attention_mixing_keeps_fp64_accuracy():
    from multihead.attention.mixing import HeadAttentionMixing

    torch.manual_seed(0)
    mix = HeadAttentionMixing(32, 4, 4, bias=True, dtype=torch.float64)
    with torch.no_grad():
        mix.head_mix.weight.normal_(0.0, 2.0)
    heads = torch.randn(2, 3, 4, 8, dtype=torch.float64)  # (B, L, H, D)
    with torch.no_grad():
        q, k, v = mix.head_mix(heads).chunk(3, dim=-1)
        expected = heads + torch.softmax(q @ k.transpose(-2, -1) / 8**0.5, dim=-1) @ v
        torch.testing.assert_close(mix(heads), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize(
    "mask_shape", [None, (1, 9), (3, 1, 1, 9), (3, 8, 1, 9), (8, 1, 9)], ids=str
)
def test_one_query_with_grouped_heads_is_folded_exactly(kv_heads, mask_shape):
    """A decoding step of GQA/MQA on 'sdpa' runs its query heads as rows of their K/V head
    (fold_query_heads); it equals the written-out formula for every mask shape that
    broadcasts to (B, H, 1, S), bool and float, with fully masked rows zeroed."""
    from multihead.attention.backends import attend

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 1, 8, 16, generator=gen, dtype=torch.float64).transpose(1, 2)  # strided
    k, v = (torch.randn(3, kv_heads, 9, 16, generator=gen, dtype=torch.float64) for _ in "kv")
    for dtype in (torch.bool, torch.float64):
        attn_mask = None
        if mask_shape is not None:
            attn_mask = torch.rand(mask_shape, generator=gen) < 0.4  # True = masked out
            if dtype != torch.bool:
                attn_mask = torch.randn(mask_shape, generator=gen, dtype=dtype)
            elif len(mask_shape) == 4:
                attn_mask[0, ...] = True  # a row with no key left: zeros
        mask = build_attention_mask(
            key_padding_mask=None, attn_mask=attn_mask, is_causal=True, batch_size=3,
            num_heads=8, q_len=1, kv_len=9, dtype=torch.float64, device=q.device,
        )  # fmt: skip
        want, _ = attend(q, k, v, mask, backend="math", dropout_p=0.0, scale=0.25)
        got, _ = attend(q, k, v, mask, backend="sdpa", dropout_p=0.0, scale=0.25)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        if mask_shape is not None and len(mask_shape) == 4 and dtype == torch.bool:
            assert got[0].abs().max() == 0
