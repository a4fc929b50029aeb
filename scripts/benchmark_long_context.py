"""What a head design buys: single-token decoding at long context, against HF's own paths.

    python scripts/benchmark_long_context.py                       # every design and setting
    python scripts/benchmark_long_context.py --settings 4096x8     # context 4,096, batch 8
    python scripts/benchmark_long_context.py --designs mha --settings 16384x1 \\
        --candidates hf-static ours-static ours-append            # the in-place cache
    python scripts/benchmark_long_context.py --designs mla --settings 4096x1 4096x8
    python scripts/benchmark_long_context.py --device cuda --dtypes bf16   # on a GPU

Decoder-only models of one reference shape (by default a Llama of 135M parameters: width
1,024, 16 heads of 64, 8 layers, SwiGLU 2,816, vocabulary 32,000) with random weights, and
a cache prefilled with random keys and values: speed does not depend on the numbers. Each
design is the shape with other K/V heads:

* ``mha``, ``gqa`` (H/4 K/V heads), ``mqa``: HF's ``LlamaForCausalLM``;
* ``mla``: HF's ``DeepseekV3ForCausalLM`` at 1/8 of MHA's cache per token and layer,
  rotary key included (``kv_lora_rank`` 224 + ``qk_rope_head_dim`` 32 = 256 numbers against
  MHA's 2 x 16 x 64 = 2,048), ``qk_nope_head_dim`` = ``v_head_dim`` = 64, dense MLPs.

Candidates (``--candidates``), each on its own copy of the model:

* ``hf-static``, ``hf-dynamic``: HF's own model with ``attn_implementation="sdpa"`` on its
  ``StaticCache`` (its fastest CPU path; the anchor of the ``x HF`` column) and on its
  ``DynamicCache`` (its default);
* ``ours-static``, ``ours-append``: the project's path, ``prepare_for_decoding`` after
  ``attn_implementation="multihead"`` (Llama) or ``replace_hf_attention`` (DeepSeek: the
  layer's MLA, absorbed), on ``StaticCache`` and on :class:`AppendCache`;
* ``ours-expanded``: MLA only, the same with the K/V re-expanded from the cached latent at
  every step (what absorption buys);
* ``ours-plain``: ``attn_implementation="multihead"`` without ``prepare_for_decoding``
  (what the packed weights buy); not in the default list.

Method. Per design, dtype and setting (context ``S`` x batch ``B``), every candidate's cache
is built, filled with ``S`` random positions, decoded one step to warm up, then
``--steps`` steps are timed one by one; candidates alternate within each of ``--rounds``
rounds (a cache is rebuilt each round, so only one is held at a time), and the table gives
the median step. Prefill is timed separately, once per design and candidate, on a prompt of
``--prefill`` tokens at batch 1.

Columns: ms per step (= per token of each sequence), tokens/s (``B`` / step), the step as a
multiple of ``hf-static``'s and of the roofline, the cache bytes actually held (the storage
of the cache's tensors after the steps, spare room included), and the peak RSS the
candidate added (``VmHWM`` after its steps less the RSS before its cache was built; the
high-water mark is reset through ``/proc/self/clear_refs``).

The roofline of a step is ``max(bytes / bandwidth, FLOPs / GEMM peak)``, both measured at
the start of the run: bandwidth as the best of 5 sums over a 1 GiB buffer on all threads,
the GEMM peak as the best of 5 products of 2,048-square matrices in the run's dtype. Bytes:
every linear weight (the embedding's one row aside) and the design's cache of ``S``
positions, each read once. FLOPs: two per weight and row, and the attention's products
(MLA absorbed: the latent is one K/V head of ``r + d_R`` for scores and ``r`` for values).

Host: the CPU's name and whether it has native bf16 (AVX512-BF16 or AMX) are printed; bf16
runs only where it has (``--dtypes``), or on CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import multihead.cli  # noqa: F401  (names the train extra when it is missing)

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    StaticCache,
)

from multihead.host import cpu_info, cpu_model
from multihead.integrations.huggingface import (
    AppendCache,
    prepare_for_decoding,
    register,
    replace_hf_attention,
)
from multihead.timing import wall_seconds

DESIGNS = ("mha", "gqa", "mqa", "mla")
CANDIDATES = ("hf-static", "hf-dynamic", "ours-static", "ours-append", "ours-expanded")
ALL_CANDIDATES = (*CANDIDATES, "ours-plain")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_SETTINGS = ("1024x1", "1024x8", "4096x1", "4096x8", "16384x1", "16384x8", "32768x1")


# --------------------------------------------------------------------------- arguments
def setting(text: str) -> tuple[int, int]:
    """``CONTEXTxBATCH``, e.g. ``4096x8``."""
    try:
        context, batch = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"setting {text!r}: expected CONTEXTxBATCH, e.g. 4096x8"
        ) from None
    if context < 1 or batch < 1:
        raise argparse.ArgumentTypeError(f"setting {text!r}: context and batch must be >= 1")
    return context, batch


def checkpoint(text: str) -> tuple[str, Path]:
    """``NAME=PATH`` of a trained checkpoint."""
    name, sep, path = text.partition("=")
    if not sep or not name or not Path(path).is_file():
        raise argparse.ArgumentTypeError(
            f"checkpoint {text!r}: expected NAME=PATH of an existing .ckpt, "
            "e.g. mha=RUN/checkpoints/last.ckpt"
        )
    return name, Path(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--designs", nargs="+", choices=DESIGNS, default=list(DESIGNS))
    p.add_argument(
        "--settings",
        nargs="+",
        type=setting,
        default=None,
        metavar="SxB",
        help=f"contexts x batches (default: {' '.join(DEFAULT_SETTINGS)})",
    )
    p.add_argument("--candidates", nargs="+", choices=ALL_CANDIDATES, default=list(CANDIDATES))
    p.add_argument(
        "--dtypes",
        nargs="+",
        choices=DTYPES,
        default=["fp32"],
        help="bf16 only where the CPU has native bf16 (or on CUDA)",
    )
    p.add_argument("--steps", type=int, default=4, help="timed steps per candidate and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefill", type=int, default=1024, help="prompt length timed once (0: no)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--memory-limit-gib",
        type=float,
        default=None,
        help="skip a candidate whose cache would need more (default: 80%% of RAM)",
    )
    p.add_argument(
        "--checkpoints",
        nargs="+",
        type=checkpoint,
        default=None,
        metavar="NAME=PATH",
        help="time these trained decoder-only LMs (experiment=lm_long checkpoints) instead of "
        "the random-weight HF models; name MHA's `mha` for the x MHA column",
    )
    p.add_argument("--json", type=Path, default=None, help="write every row here")
    p.add_argument("--plot", type=Path, default=None, help="tokens/s against context (PNG)")
    p.add_argument(
        "--profile",
        choices=(*ALL_CANDIDATES, "trained"),
        default=None,
        help="also print this candidate's ops at each setting (torch.profiler)",
    )

    args = p.parse_args(argv)
    for name in ("steps", "rounds", "hidden", "heads", "layers", "ffn", "vocab"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.hidden % args.heads or args.heads % 4:
        p.error(f"--heads ({args.heads}) must divide --hidden ({args.hidden}), a multiple of 4")
    try:
        args.device = torch.device(args.device)
    except RuntimeError as err:
        p.error(f"--device {args.device!r}: {err}")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    if "bf16" in args.dtypes and args.device.type == "cpu" and not native_bf16():
        p.error("--dtypes bf16: this CPU has no native bf16 (AVX512-BF16 or AMX)")
    args.settings = args.settings or [setting(s) for s in DEFAULT_SETTINGS]
    return args


# --------------------------------------------------------------------------- the host
def native_bf16() -> bool:
    flags = set(cpu_info().get("flags", "").split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def host_line(device: torch.device) -> str:
    if device.type == "cuda":
        return f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}"
    flags = set(cpu_info().get("flags", "").split())
    bf16 = sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile"})
    return (
        f"cpu: {cpu_model()}, {os.cpu_count()} logical cores, {torch.get_num_threads()} torch "
        f"threads; native bf16: {'yes (' + ' '.join(bf16) + ')' if bf16 else 'no'}; "
        f"torch {torch.__version__}, kernels {torch.backends.cpu.get_cpu_capability()}"
    )


def measure_bandwidth(device: torch.device) -> float:
    """Read bandwidth, bytes/s: the best of 5 sums of a 1 GiB buffer (CUDA: 4 GiB)."""
    n = (4 if device.type == "cuda" else 1) * 2**30 // 4
    buffer = torch.ones(n, device=device)
    best = min(wall_seconds(buffer.sum, device) for _ in range(6))
    del buffer
    return n * 4 / best


def measure_gemm_peak(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of the best of 5 products of square matrices (2,048 on the CPU, 8,192 on CUDA)."""
    n = 8192 if device.type == "cuda" else 2048
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    best = min(wall_seconds(lambda: a @ b, device) for _ in range(6))
    return 2 * n**3 / best


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def reset_peak_rss() -> bool:
    """Reset the high-water mark VmHWM (Linux: ``5`` into ``/proc/self/clear_refs``)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


# --------------------------------------------------------------------------- the models
@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    layers: int
    ffn: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def mla(self) -> dict[str, int]:
        """MLA at 1/8 of MHA's cache: r + d_R = 2 H D / 8, d_R = D / 2."""
        cache = 2 * self.heads * self.head_dim // 8
        rope = self.head_dim // 2
        return dict(
            kv_lora_rank=cache - rope, qk_rope_head_dim=rope, qk_nope_head_dim=self.head_dim,
            v_head_dim=self.head_dim,
        )  # fmt: skip

    def kv_heads(self, design: str) -> int:
        return {"mha": self.heads, "gqa": self.heads // 4, "mqa": 1, "mla": self.heads}[design]

    def cache_numbers(self, design: str) -> int:
        """Numbers cached per position and layer, by the design's own layout."""
        if design == "mla":
            mla = self.mla()
            return mla["kv_lora_rank"] + mla["qk_rope_head_dim"]
        return 2 * self.kv_heads(design) * self.head_dim


def build_model(design: str, shape: Shape, dtype: torch.dtype, device: torch.device):
    common = dict(
        hidden_size=shape.hidden, num_attention_heads=shape.heads, num_hidden_layers=shape.layers,
        intermediate_size=shape.ffn, vocab_size=shape.vocab, max_position_embeddings=1 << 17,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    if design == "mla":
        config = DeepseekV3Config(
            num_key_value_heads=shape.heads, q_lora_rank=None, first_k_dense_replace=shape.layers,
            n_routed_experts=1, num_experts_per_tok=1, n_group=1, topk_group=1,
            rope_interleave=False, **shape.mla(), **common,
        )  # fmt: skip
        model_class = DeepseekV3ForCausalLM
    else:
        config = LlamaConfig(num_key_value_heads=shape.kv_heads(design), **common)
        model_class = LlamaForCausalLM
    with torch.device(device):
        # Built in dtype, not cast after: HF keeps the rotary frequencies in fp32 then.
        model = model_class._from_config(config, dtype=dtype).eval()
    model.set_attn_implementation("sdpa")
    return model


def prepare(model, design: str, candidate: str):
    """The candidate's copy of ``model``."""
    if candidate.startswith("hf-"):
        return model
    register()  # the "multihead" names (idempotent)
    model = copy.deepcopy(model)
    if design == "mla":
        replace_hf_attention(model)
        if candidate == "ours-expanded":
            for module in model.modules():
                if hasattr(module, "absorb"):
                    module.absorb = False
    else:
        model.set_attn_implementation("multihead")
    return model if candidate == "ours-plain" else prepare_for_decoding(model)


def linear_numbers(model) -> int:
    """Weights of every nn.Linear (all are read at every step; the embedding is not)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


# --------------------------------------------------------------------------- the cache
def new_cache(candidate: str, model, context: int, steps: int):
    config = model.config
    if candidate == "hf-dynamic":
        return DynamicCache(config=config)
    if candidate == "ours-append":
        return AppendCache(config=config)
    return StaticCache(config=config, max_cache_len=context + steps)


@torch.inference_mode()
def filled_cache(candidate: str, model, context: int, batch: int, steps: int, device):
    """A cache holding ``context`` random positions: one real step sets each layer's shapes
    (whatever the model caches), then every layer is refilled at random."""
    cache = new_cache(candidate, model, context, steps)
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    model(input_ids=token, cache=cache, use_cache=True)
    for layer in cache.layers:
        if isinstance(cache, StaticCache):
            layer.keys.uniform_(-1, 1)
            layer.values.uniform_(-1, 1)
            layer.cumulative_length.fill_(context)
        else:
            keys, values = layer.keys, layer.values
            layer.reset()
            shape = lambda t: (*t.shape[:2], context, t.shape[-1])  # noqa: E731
            new_keys = torch.empty(shape(keys), dtype=keys.dtype, device=device).uniform_(-1, 1)
            new_values = torch.empty(shape(values), dtype=values.dtype, device=device)
            layer.update(new_keys, new_values.uniform_(-1, 1))
    return cache


def held_bytes(cache) -> int:
    """Bytes of the storages the cache's tensors hold, each storage once."""
    storages = {}
    for layer in cache.layers:
        for t in (layer.keys, layer.values, getattr(layer, "_key_buffer", None),
                  getattr(layer, "_value_buffer", None)):  # fmt: skip
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                storages[storage.data_ptr(), t.device] = storage.nbytes()
    return sum(storages.values())


@torch.inference_mode()
def rewind(cache, context: int) -> None:
    """Back to ``context`` positions after the timed steps."""
    for layer in cache.layers:
        if isinstance(cache, StaticCache):
            layer.cumulative_length.fill_(context)
        else:
            layer.crop(context - layer.get_seq_length())


def estimated_cache_bytes(shape: Shape, design: str, candidate: str, context, batch, dtype):
    per = shape.cache_numbers(design) * shape.layers * batch * dtype.itemsize
    if candidate.startswith("hf") and design == "mla":
        per = (shape.mla()["kv_lora_rank"] + shape.mla()["qk_rope_head_dim"]) * shape.layers
        per *= batch * dtype.itemsize
    factor = {"hf-dynamic": 2, "ours-append": 1.25}.get(candidate, 1)  # a copy / spare room
    return per * (context + 64) * factor


# --------------------------------------------------------------------------- the roofline
def roofline_seconds(shape: Shape, design, weights, context, batch, dtype, bandwidth, peak):
    D, H, layers = shape.head_dim, shape.heads, shape.layers
    cache_bytes = shape.cache_numbers(design) * context * batch * layers * dtype.itemsize
    weight_bytes = weights * dtype.itemsize
    if design == "mla":
        mla = shape.mla()
        r, rope = mla["kv_lora_rank"], mla["qk_rope_head_dim"]
        attention = 2 * batch * H * context * (r + rope + r) * layers
    else:
        attention = 2 * batch * H * context * 2 * D * layers
    flops = 2 * batch * weights + attention
    return max((cache_bytes + weight_bytes) / bandwidth, flops / peak)


# --------------------------------------------------------------------------- timing
@dataclass
class Row:
    design: str
    dtype: str
    context: int
    batch: int
    candidate: str
    ms: float | None = None  # the median over rounds of each round's median step
    ms_min: float | None = None  # the fastest and slowest round's median step
    ms_max: float | None = None
    tokens_per_s: float | None = None
    x_hf: float | None = None  # step time over hf-static's of the same design, median over rounds
    x_hf_min: float | None = None
    x_hf_max: float | None = None
    x_mha: float | None = None  # speed as a multiple of MHA's (same candidate), median over rounds
    x_mha_min: float | None = None
    x_mha_max: float | None = None
    x_roofline: float | None = None
    roofline_ms: float | None = None
    cache_bytes: int | None = None
    peak_rss_added: int | None = None
    round_ms: list[float] | None = None  # each round's median step
    steps_ms: list[float] | None = None
    note: str = ""


@dataclass
class Entry:
    """One thing timed at every setting: a design's model on one candidate path."""

    design: str
    candidate: str
    model: object
    fill: object  # (context, batch, steps) -> a cache holding `context` positions
    step: object  # (cache, batch) -> None: one decoding step of `batch` sequences
    held: object  # cache -> bytes its storage holds
    need: object  # (context, batch) -> bytes its cache will need, roughly
    roofline_ms: object = None  # (context, batch) -> the step's roofline, or None


def time_steps(step, cache, batch, steps, device) -> list[float]:
    """Milliseconds of each of ``steps`` decoding steps, after one untimed warm-up step."""
    with torch.inference_mode():
        step(cache, batch)  # warm-up
        return [wall_seconds(lambda: step(cache, batch), device) * 1000 for _ in range(steps)]


def profile_step(step, cache, batch) -> str:
    from torch.profiler import profile

    with torch.inference_mode(), profile() as prof:
        for _ in range(3):
            step(cache, batch)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def hf_entries(args, dtype_name, shape, bandwidth, peak) -> list[Entry]:
    """Every design x candidate of the random-weight reference shape (one model per design
    and kind of path: ``ours-static`` and ``ours-append`` share theirs)."""
    dtype, device = DTYPES[dtype_name], args.device
    entries = []
    for design in args.designs:
        base = build_model(design, shape, dtype, device)
        weights = linear_numbers(base)
        prepared = {}
        for c in args.candidates:
            if c == "ours-expanded" and design != "mla":
                continue
            kind = (
                "hf"
                if c.startswith("hf-")
                else c
                if c in ("ours-expanded", "ours-plain")
                else "ours"
            )
            if kind not in prepared:
                prepared[kind] = prepare(base, design, c)
            model = prepared[kind]

            def fill(context, batch, steps, c=c, model=model):
                return filled_cache(c, model, context, batch, steps, device)

            def step(cache, batch, model=model):
                token = torch.zeros(batch, 1, dtype=torch.long, device=device)
                model(input_ids=token, cache=cache, use_cache=True)

            def need(context, batch, c=c, design=design):
                return estimated_cache_bytes(shape, design, c, context, batch, dtype)

            def roof(context, batch, design=design, weights=weights):
                seconds = roofline_seconds(
                    shape, design, weights, context, batch, dtype, bandwidth, peak
                )
                return seconds * 1000

            entries.append(Entry(design, c, model, fill, step, held_bytes, need, roof))
    return entries


def checkpoint_entries(args) -> list[Entry]:
    """The trained decoder-only LMs of ``--checkpoints NAME=PATH`` on their own KV cache
    (``DecoderLM.make_cache``), filled with random keys and values to the context."""
    from multihead.checkpoints import load_trained_model

    entries = []
    for name, path in args.checkpoints:
        model = load_trained_model(path).model.to(args.device).eval()

        @torch.inference_mode()
        def fill(context, batch, steps, model=model):
            # Rotary positions have no table: past the trained context the model still
            # decodes (its quality aside), so its position limit is raised to the setting's.
            limit = max(model.embedding.max_positions, context + steps + 1)
            model.embedding.max_positions = model.max_positions = limit
            caches = model.make_cache(batch, context + steps + 1)
            for cache in caches.kv:
                cache.k.uniform_(-1, 1)
                if not cache.share_kv:
                    cache.v.uniform_(-1, 1)
                cache.size = context
            return caches

        def step(caches, batch, model=model):
            model(torch.zeros(batch, 1, dtype=torch.long, device=args.device), caches)

        def held(caches):
            return sum(c.k.nbytes + (0 if c.share_kv else c.v.nbytes) for c in caches.kv)

        def need(context, batch, model=model):
            return model.kv_cache_bytes_per_token() * batch * (context + args.steps + 2)

        entries.append(Entry(name, "trained", model, fill, step, held, need))
    return entries


def run_setting(args, entries: list[Entry], dtype_name: str, context: int, batch: int):
    """Rows of one setting: every entry timed once a round, the designs and candidates
    interleaved (the order turns by one each round, so none is always first), ``--rounds``
    rounds; each round's median step, then their median and min-max, and per round the
    ratios to MHA's entry of the same candidate and to ``hf-static`` of the same design."""
    device = args.device
    limit = args.memory_limit_gib * 2**30 if args.memory_limit_gib else 0.8 * _total_memory()
    rows = {}
    for e in entries:
        row = Row(e.design, dtype_name, context, batch, e.candidate, round_ms=[], steps_ms=[])
        row.roofline_ms = e.roofline_ms(context, batch) if e.roofline_ms else None
        if device.type == "cpu" and e.need(context, batch) > limit - rss_bytes():
            row.note = f"skipped: its cache needs about {e.need(context, batch) / 2**30:.1f} GiB"
        rows[e.design, e.candidate] = row
    for r in range(args.rounds):
        for e in entries[r % len(entries) :] + entries[: r % len(entries)]:
            row = rows[e.design, e.candidate]
            if row.note:
                continue
            gc.collect()
            before = rss_bytes()
            reset_peak_rss()
            cache = e.fill(context, batch, args.steps + 1)
            times = time_steps(e.step, cache, batch, args.steps, device)
            row.steps_ms += [round(t, 3) for t in times]
            row.round_ms.append(statistics.median(times))
            row.cache_bytes = e.held(cache)
            if device.type == "cpu":
                row.peak_rss_added = max(0, peak_rss_bytes() - before)
            if args.profile == e.candidate:
                print(f"\n{e.design} {dtype_name} {context}x{batch} {e.candidate}:", flush=True)
                print(profile_step(e.step, cache, batch), flush=True)
            del cache
    for row in rows.values():
        if not row.round_ms:
            continue
        row.ms, row.ms_min, row.ms_max = _spread(row.round_ms)
        row.tokens_per_s = batch * 1000 / row.ms
        if row.roofline_ms:
            row.x_roofline = row.ms / row.roofline_ms
        hf = rows.get((row.design, "hf-static"))
        if hf is not None and hf.round_ms:
            ratios = [a / b for a, b in zip(row.round_ms, hf.round_ms, strict=True)]
            row.x_hf, row.x_hf_min, row.x_hf_max = _spread(ratios)
        mha = rows.get(("mha", row.candidate))
        if mha is not None and mha.round_ms:
            ratios = [m / a for a, m in zip(row.round_ms, mha.round_ms, strict=True)]
            row.x_mha, row.x_mha_min, row.x_mha_max = _spread(ratios)
    print_rows(list(rows.values()), flush=True)
    return list(rows.values())


def _spread(values: list[float]) -> tuple[float, float, float]:
    """Median, min and max of per-round figures."""
    return statistics.median(values), min(values), max(values)


def prefill_rows(args, dtype_name, entries: list[Entry]) -> list[Row]:
    """One real prefill of ``--prefill`` tokens at batch 1 per HF-path model (its own cache)."""
    rows = []
    ids = torch.randint(0, args.vocab, (1, args.prefill), device=args.device)
    for e in entries:
        cache = new_cache(e.candidate, e.model, args.prefill, 1)
        with torch.inference_mode():
            seconds = wall_seconds(lambda: e.model(input_ids=ids, cache=cache), args.device)  # noqa: B023
        rows.append(Row(e.design, dtype_name, args.prefill, 1, e.candidate, ms=seconds * 1000,
                        note="prefill"))  # fmt: skip
    print(
        f"prefill of {args.prefill} tokens, batch 1, {dtype_name}: "
        + ", ".join(f"{r.design} {r.candidate} {r.ms:.0f} ms" for r in rows),
        flush=True,
    )
    return rows


def _total_memory() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return float("inf")


# --------------------------------------------------------------------------- output
_printed_header = False


def print_rows(rows: list[Row], flush: bool = False) -> None:
    global _printed_header
    if not _printed_header:
        print(
            "\n| design | dtype | context x batch | candidate | ms/token (min-max of rounds) "
            "| tokens/s | speed x MHA (min-max) | time x HF static (min-max) | x roofline "
            "| cache MiB held | peak RSS added MiB | note |\n"
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"
        )
        _printed_header = True
    for r in rows:
        if r.note == "prefill":
            continue
        ms = r.ms and f"{r.ms:,.2f} ({r.ms_min:,.2f}-{r.ms_max:,.2f})"
        x_mha = r.x_mha and f"{r.x_mha:.2f} ({r.x_mha_min:.2f}-{r.x_mha_max:.2f})"
        x_hf = r.x_hf and f"{r.x_hf:.2f} ({r.x_hf_min:.2f}-{r.x_hf_max:.2f})"
        cells = [
            r.design, r.dtype, f"{r.context} x {r.batch}", r.candidate, ms or "",
            _num(r.tokens_per_s, 1), x_mha or "", x_hf or "", _num(r.x_roofline, 2),
            _num(r.cache_bytes and r.cache_bytes / 2**20, 1),
            _num(r.peak_rss_added and r.peak_rss_added / 2**20, 0), r.note,
        ]  # fmt: skip
        print("| " + " | ".join(cells) + " |", flush=flush)


def _num(value, digits: int) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in rows if r.note != "prefill"]
    batches = sorted({r.batch for r in steps})
    dtypes = list(dict.fromkeys(r.dtype for r in steps))
    fig, axes = plt.subplots(
        len(dtypes), len(batches), figsize=(6 * len(batches), 4.5 * len(dtypes)), squeeze=False
    )
    designs = list(dict.fromkeys(r.design for r in steps))
    colors = {d: f"C{i}" for i, d in enumerate(designs)}
    for row, dtype in zip(axes, dtypes, strict=True):
        for ax, batch in zip(row, batches, strict=True):
            for design in designs:
                best = {
                    r.context: r
                    for r in steps
                    if (r.design, r.dtype, r.batch) == (design, dtype, batch)
                    and r.candidate in ("ours-static", "trained")
                    and r.ms
                }
                if not best:
                    continue
                contexts = sorted(best)
                speed = [best[c].tokens_per_s for c in contexts]
                low = [batch * 1000 / best[c].ms_max for c in contexts]
                high = [batch * 1000 / best[c].ms_min for c in contexts]
                ax.plot(contexts, speed, "o-", color=colors[design], label=design)
                ax.fill_between(contexts, low, high, color=colors[design], alpha=0.2)
                if all(best[c].roofline_ms for c in contexts):
                    roof = [batch * 1000 / best[c].roofline_ms for c in contexts]
                    ax.plot(contexts, roof, "--", color=colors[design], alpha=0.6)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("tokens/s")
            ax.set_title(f"{dtype}, batch {batch}; band: min-max of rounds; dashed: roofline")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = Shape(args.hidden, args.heads, args.layers, args.ffn, args.vocab)
    print(host_line(args.device))
    print("command: python scripts/benchmark_long_context.py " + " ".join(sys.argv[1:]))
    rows: list[Row] = []
    for dtype_name in args.dtypes:
        if args.checkpoints:  # trained models: their own dtype (fp32) and cache
            entries = checkpoint_entries(args)
        else:
            bandwidth = measure_bandwidth(args.device)
            peak = measure_gemm_peak(args.device, DTYPES[dtype_name])
            print(
                f"{dtype_name}: read bandwidth {bandwidth / 1e9:.1f} GB/s, GEMM peak "
                f"{peak / 1e9:.0f} GFLOP/s (the roofline's)",
                flush=True,
            )
            entries = hf_entries(args, dtype_name, shape, bandwidth, peak)
            if args.prefill:
                rows += prefill_rows(args, dtype_name, entries)
        for context, batch in args.settings:
            rows += run_setting(args, entries, dtype_name, context, batch)
        del entries
        gc.collect()
    print("\nAll rows:")
    globals()["_printed_header"] = False
    print_rows(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(rows, args.plot)
        print(f"figure: {args.plot}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
