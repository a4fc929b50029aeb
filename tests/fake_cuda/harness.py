"""Fake ``cuda:0``: the project's GPU code paths, run on a machine without a GPU.

Inside :class:`FakeCuda` every tensor is a ``FakeTensor`` (``torch._subclasses``): it has a
shape, a dtype and a device but no data, and each op runs its meta implementation. Devices
are checked as CUDA checks them: an op that mixes ``cuda:0`` with a CPU tensor (other than a
0-dim scalar) raises. Autocast and ``GradScaler`` are switched on for ``"cuda"`` as if a GPU
were there, so CUDA's own autocast policy picks each op's dtype.

What needs the data, and so would make the host wait for the device on a GPU (``.item()``,
``bool(t)``, ``nonzero``, ``equal``, a copy to the host), gets an answer the test chooses
(:class:`Answers`) and is recorded with the project line that asked (:attr:`FakeCuda.syncs`).
A test reaches both sides of a data-dependent branch by choosing the answers.

Needs a CUDA build of torch: the CPU build aborts when it records autograd on fake CUDA
tensors. ``backward()`` does not run on a fake device (it looks for a CUDA context), so the
tests call autograd Functions' ``backward`` themselves and give optimizers synthetic
gradients. Nothing runs a kernel: the numbers are the GPU's to tell (``docs/gpu.md``).
"""

from __future__ import annotations

import importlib.machinery
import sys
import traceback
import types
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode

from multihead.model import Transformer
from multihead.training import TranslationModule

CUDA = torch.device("cuda", 0)
SRC = str(Path(__file__).resolve().parents[2] / "src" / "multihead")
aten = torch.ops.aten


@dataclass
class Answers:
    """What the fake device answers when the host reads its data.

    Attributes:
        flag: ``bool(t)`` of a bool tensor (``if t.any():``).
        integer: ``int(t)`` or ``.item()`` of an integer tensor, and each element that
            ``.tolist()`` reads.
        real: ``float(t)`` or ``.item()`` of a floating-point tensor (``GradScaler`` reads
            its found-inf count this way: ``0.0`` lets the optimizer step, ``1.0`` skips it).
        keep: how many of the ``n`` elements of a ``nonzero`` input are nonzero.
    """

    flag: bool = False
    integer: int = 1
    real: float = 0.0
    keep: Callable[[int], int] = field(default=lambda n: n)


@dataclass(frozen=True)
class Sync:
    """One read of device data by the host: the op and the project line that asked."""

    op: str
    site: str


def _site() -> str:
    """``file:line`` of the innermost frame in ``src/multihead``, else the test's own."""
    frames = traceback.extract_stack()[:-3]
    for frame in reversed(frames):
        if frame.filename.startswith(SRC):
            return f"{Path(frame.filename).relative_to(Path(SRC).parent)}:{frame.lineno}"
    for frame in reversed(frames):
        if "/torch/" not in frame.filename and "/fake_cuda/harness" not in frame.filename:
            return f"{Path(frame.filename).name}:{frame.lineno}"
    return "?"


class _Reads(TorchDispatchMode):
    """Above the fake mode: answers and records the ops that read device data."""

    def __init__(self, answers: Answers, syncs: list[Sync]) -> None:
        super().__init__()
        self.answers = answers
        self.syncs = syncs

    def _record(self, op: str, t: Tensor) -> None:
        if t.device.type == "cuda":
            self.syncs.append(Sync(op, _site()))

    def _scalar(self, t: Tensor) -> bool | int | float:
        constant = getattr(t, "constant", None)
        if constant is not None:  # a tensor made from Python numbers knows its value
            with no_dispatch():
                return constant.item()
        if t.dtype == torch.bool:
            return self.answers.flag
        return self.answers.real if t.is_floating_point() else self.answers.integer

    def _nonzero(self, t: Tensor) -> Tensor:
        self._record("nonzero", t)
        n = self.answers.keep(t.numel())
        if not 0 <= n <= t.numel():
            raise ValueError(f"Answers.keep gave {n} nonzero of {t.numel()} elements")
        return torch.empty((n, t.dim()), dtype=torch.long, device=t.device)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten._local_scalar_dense.default, aten.is_nonzero.default, aten.item.default):
            # bool(t) and .item() reach here as is_nonzero or item under inference mode.
            self._record("item", args[0])
            return self._scalar(args[0])
        if func is aten.nonzero.default:
            return self._nonzero(args[0])
        if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
            # A boolean mask index is a nonzero inside the op: x[mask], x[mask] = y.
            indices = []
            for index in args[1]:
                if index is not None and index.dtype in (torch.bool, torch.uint8):
                    indices.extend(self._nonzero(index).unbind(1))
                else:
                    indices.append(index)
            args = (args[0], indices, *args[2:])
        if func is aten.equal.default:
            self._record("equal", args[0])
            return True
        if func.overloadpacket in (aten._to_copy, aten.to) and _to_host(args, kwargs):
            self._record("copy to host", args[0])
        if func is aten.copy_.default and args[0].device.type == "cpu":
            self._record("copy to host", args[1])
        return func(*args, **kwargs)


def _to_host(args: tuple, kwargs: dict) -> bool:
    """Whether a ``_to_copy`` / ``to`` call moves its tensor to the CPU."""
    targets = [kwargs.get("device"), *(a for a in args[1:] if isinstance(a, torch.device | str))]
    return any(t is not None and torch.device(t).type == "cpu" for t in targets)


_fake_tolist = FakeTensor.tolist


def _tolist(self: Tensor) -> list:
    # On a GPU, tolist copies the tensor to the host once; a FakeTensor would read it element
    # by element instead, so the copy is made here, where it is recorded as one read.
    return _fake_tolist(self.cpu() if self.device.type == "cuda" else self)


class FakeCuda:
    """A fake ``cuda:0`` with CUDA's autocast policy; see the module docstring.

    Use as a context manager; inside it every new tensor is fake, and :meth:`model` moves a
    module's parameters and buffers onto the fake device.

    Args:
        answers: what reads of device data return; change it between steps as needed.
    """

    def __init__(self, answers: Answers | None = None) -> None:
        self.answers = answers or Answers()
        self.syncs: list[Sync] = []
        self.mode = FakeTensorMode()
        self._stack: ExitStack | None = None

    def model(self, module: nn.Module) -> nn.Module:
        """``module`` with every parameter and buffer on the fake ``cuda:0`` (tied ones stay
        tied). Call it outside the ``with`` block, on a module built on the CPU."""
        fakes: dict[int, Tensor] = {}
        for sub in module.modules():
            for name, p in sub._parameters.items():
                if p is not None:
                    if id(p) not in fakes:
                        fake = FakeTensor(self.mode, p.detach().to("meta"), CUDA)
                        fakes[id(p)] = nn.Parameter(fake, requires_grad=p.requires_grad)
                    sub._parameters[name] = fakes[id(p)]
            for name, b in sub._buffers.items():
                if b is not None:
                    sub._buffers[name] = FakeTensor(self.mode, b.to("meta"), CUDA)
        return module

    @property
    def counts(self) -> Counter:
        """Reads of device data so far, by project line."""
        return Counter(s.site for s in self.syncs)

    @contextmanager
    def counting(self) -> Iterator[list[Sync]]:
        """The reads made inside the ``with`` block (a list filled when it ends)."""
        start = len(self.syncs)
        made: list[Sync] = []
        try:
            yield made
        finally:
            made.extend(self.syncs[start:])

    def __enter__(self) -> FakeCuda:
        stack = ExitStack()
        # As if a GPU with native bf16 were there: autocast and GradScaler look no further.
        stack.enter_context(
            mock.patch("torch.cuda.amp.common.amp_definitely_not_available", lambda: False)
        )
        stack.enter_context(mock.patch("torch.cuda.is_bf16_supported", lambda *a, **k: True))
        stack.enter_context(mock.patch.object(FakeTensor, "tolist", _tolist))
        stack.enter_context(
            mock.patch("torch.cuda.synchronize", lambda device=None: self._synchronize())
        )
        stack.enter_context(mock.patch("torch.cuda.max_memory_allocated", lambda device=None: 0))
        stack.enter_context(self.mode)
        stack.enter_context(_Reads(self.answers, self.syncs))
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        assert self._stack is not None
        self._stack.__exit__(*exc)
        self._stack = None

    def _synchronize(self) -> None:
        self.syncs.append(Sync("synchronize", _site()))


def synthetic_grads(module: nn.Module) -> None:
    """Give every trainable parameter a gradient (fake, like the parameter): what backward
    would leave for the optimizer, which cannot run on the fake device."""
    for p in module.parameters():
        if p.requires_grad:
            p.grad = torch.empty_like(p)


# --------------------------------------------------------------------------- kernel stubs
class KernelRuleError(AssertionError):
    """A kernel stub was called with inputs the real kernel's documented rules refuse."""


def _require(ok: bool, kernel: str, rule: str) -> None:
    if not ok:
        raise KernelRuleError(f"{kernel}: {rule}")


# Torch's SDPA kernels as ``torch.backends.cuda`` names them once ``sdpa_kernel`` pins one.
_SDPA_FLAGS = {
    "flash": torch.backends.cuda.flash_sdp_enabled,
    "efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
    "cudnn": torch.backends.cuda.cudnn_sdp_enabled,
    "math": torch.backends.cuda.math_sdp_enabled,
}


def _sdpa_rules(name, q, k, v, attn_mask, dropout_p, is_causal, enable_gqa) -> None:
    """The input rules of PyTorch's fused SDPA kernels (``sdp_utils.cpp``, torch 2.13)."""
    for t in (q, k, v):
        _require(t.device.type == "cuda", name, f"needs CUDA tensors, got {t.device}")
        _require(t.dim() == 4, name, f"needs (B, H, L, D) tensors, got {tuple(t.shape)}")
        _require(t.dtype == q.dtype, name, f"q, k, v dtypes differ: {q.dtype}, {t.dtype}")
        _require(t.stride(-1) == 1 or t.shape[-1] == 1, name, "last dim must be contiguous")
        _require(t.shape[2] > 0, name, "empty sequence")
    D = q.shape[-1]
    half = q.dtype in (torch.float16, torch.bfloat16)
    if attn_mask is not None:
        _require(attn_mask.device == q.device, name, f"mask on {attn_mask.device}")
        _require(attn_mask.dtype in (torch.bool, q.dtype), name, f"mask dtype {attn_mask.dtype}")
    same_heads = k.shape[1] == q.shape[1] and v.shape[1] == q.shape[1]
    if name == "flash":
        _require(half, name, f"fp16/bf16 only, got {q.dtype}")
        _require(attn_mask is None, name, "takes no attn_mask")
        _require(D <= 256 and D % 8 == 0, name, f"head_dim {D}: at most 256, a multiple of 8")
        _require(
            not is_causal or q.shape[2] == k.shape[2], name, "is_causal needs L == S (top-left)"
        )
        _require(same_heads or enable_gqa, name, "grouped K/V heads need enable_gqa")
    elif name == "efficient":
        _require(q.dtype in (torch.float16, torch.bfloat16, torch.float32), name, str(q.dtype))
        align = 8 if half else 4
        _require(D % align == 0, name, f"head_dim {D} must be a multiple of {align}")
        _require(same_heads, name, "no grouped K/V heads (enable_gqa)")
    elif name == "cudnn":
        _require(half, name, f"fp16/bf16 only, got {q.dtype}")
        _require(D <= 128 and D % 8 == 0, name, f"head_dim {D}: at most 128, a multiple of 8")
        _require(q.shape[2] > 1 and k.shape[2] > 1, name, "sequence length 1 (L or S)")


@contextmanager
def kernel_stubs(calls: list[str] | None = None) -> Iterator[list[str]]:
    """Stand-ins for the fused kernels that cannot run on the fake device: pinned SDPA
    kernels, FlexAttention and the flash-attn package. Each checks its kernel's documented
    input rules (:class:`KernelRuleError` names the broken one), records its name in
    ``calls`` and returns an empty output of the right shape, dtype and device.

    ``sdpa`` with every kernel enabled goes to PyTorch's own dispatcher, as on a GPU.
    """
    calls = [] if calls is None else calls
    real_sdpa = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        enabled = [n for n, flag in _SDPA_FLAGS.items() if flag()]
        if len(enabled) != 1 or enabled == ["math"]:
            return real_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, **kw)
        name = enabled[0]
        if torch.is_autocast_enabled("cuda"):  # as the dispatcher's autocast, before the kernel
            dtype = torch.get_autocast_dtype("cuda")
            q, k, v = (t.to(dtype) for t in (q, k, v))
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = attn_mask.to(dtype)
        _sdpa_rules(name, q, k, v, attn_mask, dropout_p, is_causal, kw.get("enable_gqa", False))
        calls.append(name)
        return q.new_empty((*q.shape[:-1], v.shape[-1]))

    def flex(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False, **kw):
        name = "flex"
        for t in (q, k, v):
            _require(t.device.type == "cuda", name, f"needs CUDA tensors, got {t.device}")
            _require(t.dtype == q.dtype, name, "q, k, v dtypes differ")
        # torch 2.13's inductor: "NYI: embedding dimension of the query, key, and value
        # must be at least 16".
        _require(q.shape[-1] >= 16, name, f"head_dim {q.shape[-1]} below 16")
        _require(enable_gqa or k.shape[1] == q.shape[1], name, "grouped K/V heads need enable_gqa")
        calls.append(name)
        return q.new_empty((*q.shape[:-1], v.shape[-1]))

    def check_flash_attn(q, k, v, layout: str) -> None:
        name = "flash_attn"
        for t in (q, k, v):
            _require(t.device.type == "cuda", name, f"needs CUDA tensors, got {t.device}")
            _require(t.dtype in (torch.float16, torch.bfloat16), name, f"dtype {t.dtype}")
            _require(t.dtype == q.dtype, name, "q, k, v dtypes differ")
            _require(t.stride(-1) == 1, name, "last dim must be contiguous")
            _require(t.dim() == len(layout), name, f"needs {layout}, got {tuple(t.shape)}")
        _require(q.shape[-1] <= 256, name, f"head_dim {q.shape[-1]} above 256")
        _require(q.shape[-2] % k.shape[-2] == 0, name, "K/V heads must divide the query heads")

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **kw):
        check_flash_attn(q, k, v, "BLHD")  # (B, L, H, D)
        calls.append("flash_attn")
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    def flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
        softmax_scale=None, causal=False, **kw,
    ):  # fmt: skip
        name = "flash_attn"
        check_flash_attn(q, k, v, "THD")  # (total, H, D)
        for cu in (cu_seqlens_q, cu_seqlens_k):
            _require(cu.dtype == torch.int32, name, f"cu_seqlens must be int32, got {cu.dtype}")
            _require(cu.device == q.device, name, f"cu_seqlens on {cu.device}")
            _require(cu.dim() == 1, name, "cu_seqlens must be (B + 1,)")
        _require(cu_seqlens_q.shape == cu_seqlens_k.shape, name, "cu_seqlens q/k differ")
        for m in (max_seqlen_q, max_seqlen_k):
            _require(isinstance(m, int), name, f"max_seqlen must be a Python int, got {m!r}")
        calls.append("flash_attn")
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    package = types.ModuleType("flash_attn")
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    package.flash_attn_func = flash_attn_func
    package.flash_attn_varlen_func = flash_attn_varlen_func

    import torch.nn.attention.flex_attention as flex_module

    from multihead.attention import backends

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(F, "scaled_dot_product_attention", sdpa))
        stack.enter_context(mock.patch.object(flex_module, "flex_attention", flex))
        # flex is compiled by inductor on CUDA; here the stub stands for the compiled kernel.
        stack.enter_context(mock.patch.object(torch, "compile", lambda fn, **kw: fn))
        if hasattr(backends, "_compiled_flex"):
            stack.enter_context(mock.patch.object(backends, "_compiled_flex", None))
        stack.enter_context(mock.patch.dict(sys.modules, {"flash_attn": package}))
        yield calls


# --------------------------------------------------------------------------- what the tests run
PAD, BOS, EOS = 0, 1, 2
VOCAB = 48

# The head designs, as the model's attention config (talking heads run on math only).
DESIGNS: dict[str, dict[str, Any]] = {
    "mha": {},
    "gqa": {"num_kv_heads": 2},
    "mqa": {"num_kv_heads": 1},
    "moh": {"design": "moh", "design_options": {"top_k_heads": 2, "num_shared_heads": 1}},
    "talking_heads": {"design": "talking_heads", "backend": "math"},
    "group_mlp": {"design": "group_mlp", "design_options": {"mixing_groups": 2}},
    "head_attention": {"design": "head_attention"},
}
# Precisions as a GPU run has them: None = fp32 without autocast.
AUTOCAST = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def model_on_cpu(seed: int = 0, **attention: Any) -> Transformer:
    """A small Transformer, head size 16 (FlexAttention's least on CUDA), built on the CPU."""
    torch.manual_seed(seed)
    return Transformer(
        src_vocab_size=VOCAB,
        tgt_vocab_size=VOCAB,
        d_model=64,
        ffn_dim=128,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dropout=0.1,
        max_positions=32,
        pad_id=PAD,
        attention={"num_heads": 4, **attention},
    )


def padded(shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """Token ids of ``shape`` (B, T), made on ``device`` (a fake one inside FakeCuda)."""
    return torch.randint(3, VOCAB, shape, device=device)


def autocast(dtype: torch.dtype | None):
    return torch.autocast("cuda", dtype=dtype, enabled=dtype is not None)


def tokenizer() -> SimpleNamespace:
    return SimpleNamespace(pad_id=PAD, bos_id=BOS, eos_id=EOS)


def trainer(world_size: int = 1) -> SimpleNamespace:
    """What the module reads of its trainer during a step."""
    return SimpleNamespace(
        world_size=world_size, global_step=0, is_global_zero=True, progress_bar_callback=None
    )


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def training_module(fake: FakeCuda, **kwargs) -> TranslationModule:
    """The module around :func:`model_on_cpu` on the fake device, as the trainer leaves it."""
    module = TranslationModule(
        fake.model(model_on_cpu()),
        tokenizer(),
        adam,
        beam_size=1,
        length_penalty=1.0,
        max_len_a=1.0,
        max_len_b=4,
        **kwargs,
    )
    module._trainer = trainer()
    module._device = CUDA  # what the trainer's move to the device records
    module.logged = {}
    module.log = lambda name, value, **kw: module.logged.__setitem__(name, value)
    return module.train()


def host_batch() -> dict:
    """A collated batch as the loader gives it: on the host."""
    return {"src": padded((4, 9), "cpu"), "tgt": padded((4, 7), "cpu"), "real_token_fraction": 0.9}


def one_step(fake, module, optimizer, scaler, monitor, precision) -> torch.Tensor | None:
    """One training step as Lightning runs it, with synthetic gradients for backward."""
    monitor.on_train_batch_start(None, module, None, 0)
    batch = module.transfer_batch_to_device(host_batch(), CUDA, 0)
    with autocast(AUTOCAST[precision]):
        loss = module.training_step(batch, 0)
    if loss is not None:
        synthetic_grads(module)
        if scaler is not None:
            scaler.scale(loss)  # backward would run on this
            scaler.unscale_(optimizer)
        module.on_before_optimizer_step(optimizer)
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
    monitor.on_train_batch_end(None, module, loss, batch, 0)
    return loss
