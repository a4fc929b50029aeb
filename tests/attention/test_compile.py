"""The layer under torch.compile and torch.export, on the CPU.

``fullgraph=True`` turns any graph break into an error. The graphs dynamo hands to the
compiler are counted by a backend that wraps ``aot_eager`` (AOTAutograd traces the graph
and its in-place cache writes as inductor would, without inductor's C++ build); one test
runs inductor itself.
"""

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from multihead import MultiHeadAttention

E, H, G = 16, 4, 2  # GQA: SDPA's enable_gqa and the math path's head groups both run
B, L, S = 2, 5, 7
BACKENDS = ["math", "sdpa"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # no compiled code or automatic-dynamic state from another test
    yield
    torch._dynamo.reset()


class GraphCounter:
    """A ``torch.compile`` backend that counts the graphs it compiles, then runs ``inner``."""

    def __init__(self, inner: str = "aot_eager") -> None:
        self.graphs = 0
        self.inner = torch._dynamo.lookup_backend(inner)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Callable:
        self.graphs += 1
        return self.inner(gm, example_inputs)


def _memory_and_padding() -> tuple[Tensor, Tensor]:
    memory = torch.randn(B, S, E)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, -3:] = True
    return memory, pad


CALLS = {
    "self": lambda attn, x, memory, pad: attn(x),
    "causal": lambda attn, x, memory, pad: attn(x, is_causal=True),
    "cross": lambda attn, x, memory, pad: attn(x, memory, key_padding_mask=pad),
}


@pytest.mark.parametrize("backend", [*BACKENDS, "flash"])  # flash: SDPA pinned, CPU kernel
@pytest.mark.parametrize("call", CALLS)
def test_compiled_call_is_one_graph_and_compiles_once(backend, call):
    torch.manual_seed(0)
    attn = MultiHeadAttention(E, H, G, backend=backend).eval()
    memory, pad = _memory_and_padding()
    counter = GraphCounter()
    compiled = torch.compile(attn, fullgraph=True, backend=counter)
    with torch.no_grad():
        CALLS[call](compiled, torch.randn(B, L, E), memory, pad)
        x = torch.randn(B, L, E)
        out = CALLS[call](compiled, x, memory, pad)  # same shapes: the same graph again
        expected = CALLS[call](attn, x, memory, pad)
    # One graph: the first call's backend check (a Python set in eager mode) is no guard.
    assert counter.graphs == 1
    torch.testing.assert_close(out, expected)


def test_compiled_training_step_matches_eager_gradients():
    torch.manual_seed(0)
    attn = MultiHeadAttention(E, H, G, backend="sdpa")  # train mode, dropout 0
    memory, pad = _memory_and_padding()
    x = torch.randn(B, L, E, requires_grad=True)
    counter = GraphCounter()
    compiled = torch.compile(attn, fullgraph=True, backend=counter)
    compiled(x, memory, key_padding_mask=pad).square().sum().backward()
    got = [x.grad, *(p.grad for p in attn.parameters())]
    x.grad = None
    attn.zero_grad()
    attn(x, memory, key_padding_mask=pad).square().sum().backward()
    expected = [x.grad, *(p.grad for p in attn.parameters())]
    assert counter.graphs == 1
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("backend", BACKENDS)
def test_static_cache_decodes_without_recompiling(backend):
    # A decoder layer's two attentions: causal self-attention through a static cache, then
    # cross-attention to a padded memory projected once into its cache. Prefill 2 tokens,
    # then decode one at a time.
    T = 8
    torch.manual_seed(0)
    self_attn = MultiHeadAttention(E, H, G, backend=backend).eval()
    cross_attn = MultiHeadAttention(E, H, G, backend=backend).eval()
    x = torch.randn(B, T, E)
    memory, pad = _memory_and_padding()
    self_cache = self_attn.make_kv_cache(B, T, static=True)
    cross_cache = cross_attn.make_kv_cache(B, S, static=True)
    counter = GraphCounter()
    self_step = torch.compile(self_attn, fullgraph=True, backend=counter)
    cross_step = torch.compile(cross_attn, fullgraph=True, backend=counter)

    def step(chunk: Tensor) -> Tensor:
        h = self_step(chunk, is_causal=True, kv_cache=self_cache)
        return cross_step(h, memory, key_padding_mask=pad, kv_cache=cross_cache)

    with torch.no_grad():
        outs = [step(x[:, :2]), step(x[:, 2:3])]  # prefill, then the first decoding step
        warm = counter.graphs
        outs += [step(x[:, t : t + 1]) for t in range(3, T)]
        full = cross_attn(self_attn(x, is_causal=True), memory, key_padding_mask=pad)
    assert warm == 4  # prefill and decoding, each for self- and cross-attention
    assert counter.graphs == warm
    assert int(self_cache.position) == T
    torch.testing.assert_close(torch.cat(outs, dim=1), full)


def test_sdpa_compiles_with_dynamic_shapes():
    # dynamic=True makes every size a symbol, yet SDPA's is_causal and enable_gqa must be
    # Python bools, and the attn_mask check compares symbolic sizes.
    torch.manual_seed(0)
    attn = MultiHeadAttention(E, H, G, backend="sdpa").eval()
    compiled = torch.compile(attn, fullgraph=True, dynamic=True, backend="aot_eager")

    def check(length: int) -> None:
        x = torch.randn(B, length, E)
        cache = attn.make_kv_cache(B, length + 2, static=True)
        with torch.no_grad():
            expected = attn(x, is_causal=True)
            torch.testing.assert_close(compiled(x, is_causal=True), expected)
            torch.testing.assert_close(compiled(x, is_causal=True, kv_cache=cache), expected)

    check(5)
    with torch._dynamo.config.patch(error_on_recompile=True):
        check(3)  # other sizes, the same compiled code


@pytest.mark.slow  # inductor builds C++: 15 s of CPU cold
def test_static_cache_decode_step_compiles_once_with_inductor():
    # gpt-fast's decoding: one token per step from the first, so one graph for every step.
    T = 6
    torch.manual_seed(0)
    attn = MultiHeadAttention(E, H, G, backend="sdpa").eval()
    x = torch.randn(B, T, E)
    cache = attn.make_kv_cache(B, T, static=True)
    counter = GraphCounter("inductor")
    step = torch.compile(attn, fullgraph=True, backend=counter)
    with torch.no_grad():
        steps = [step(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(T)]
        full = attn(x, is_causal=True)
    assert counter.graphs == 1
    torch.testing.assert_close(torch.cat(steps, dim=1), full)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("call", ["self", "cross"])
def test_exported_program_equals_eager(backend, call):
    torch.manual_seed(0)
    attn = MultiHeadAttention(E, H, G, backend=backend).eval()
    memory, pad = _memory_and_padding()
    x = torch.randn(B, L, E)
    if call == "self":
        args, kwargs = (x,), {"is_causal": True}
    else:
        args, kwargs = (x, memory), {"key_padding_mask": pad}
    program = torch.export.export(attn, args, kwargs)
    # New inputs of the same shapes: the program computes, it did not fold its example.
    x2 = torch.randn(B, L, E)
    args2 = (x2,) if call == "self" else (x2, torch.randn(B, S, E))
    pad2 = torch.zeros(B, S, dtype=torch.bool)
    pad2[0, -1:] = True
    kwargs2 = kwargs if call == "self" else {"key_padding_mask": pad2}
    with torch.no_grad():
        torch.testing.assert_close(program.module()(*args2, **kwargs2), attn(*args2, **kwargs2))
