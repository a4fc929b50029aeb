"""The parts below the layer: the head-design interface, the positional seams (rotate Q and
K; a score bias on every backend that takes one), the projection's two layouts, and the
import graph of ``attention/``."""

import ast
import importlib
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import multihead.attention
from multihead import MultiHeadAttention
from multihead.attention import BACKENDS, HeadDesign, PositionalPart, QKVProjection

ATTENTION = Path(multihead.attention.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_of_the_layer_calls_another_objects_private_method():
    """Each part reads on its own: it calls the public steps, never ``layer._step(...)``;
    and no module imports another's private names."""
    found = []
    for path in sorted(ATTENTION.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                own = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
                own = own or (
                    isinstance(owner, ast.Call) and getattr(owner.func, "id", "") == "super"
                )
                if _private(node.func.attr) and not own:
                    found.append(f"{path.name}:{node.lineno} calls .{node.func.attr}()")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("multihead"):
                found += [
                    f"{path.name}:{node.lineno} imports {a.name}"
                    for a in node.names
                    if _private(a.name)
                ]
    assert found == []


def test_every_design_is_a_head_design_with_its_state_dict_name():
    designs = {
        "head_gate": {"design": "moh", "top_k_heads": 2},
        "head_mix": {"design": "group_mlp"},
        "kv_latent": {"design": "mla", "kv_latent_dim": 8},
    }
    for attribute, options in designs.items():
        layer = MultiHeadAttention(16, 4, **options)
        assert isinstance(layer.design, HeadDesign) and layer.design.attribute == attribute
        assert all(
            k.startswith(("in_proj.", "out_proj.", f"{attribute}.")) for k in layer.state_dict()
        )


class ScaleByPosition(PositionalPart):
    """A toy positional part: Q and K at position p scaled by 1 + p / 10."""

    seam = "rotate"

    def rotate(self, x, positions):
        return x * (1.0 + positions.to(x.dtype) / 10)[:, None]  # positions (L,)


def test_a_positional_part_acts_on_q_and_k_after_the_projection_and_before_the_cache():
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4, num_kv_heads=2, backend="math").eval()
    layer.positions = ScaleByPosition()
    x = torch.randn(2, 5, 16)
    # Written out: project, scale Q and K rows by position, causal softmax, W^O.
    q, k, v = F.linear(x, layer.in_proj.weight, layer.in_proj.bias).split([16, 8, 8], dim=-1)
    q = q.view(2, 5, 4, 4).transpose(1, 2)
    k, v = (t.view(2, 5, 2, 4).transpose(1, 2).repeat_interleave(2, dim=1) for t in (k, v))
    s = (1.0 + torch.arange(5) / 10)[:, None]
    scores = (q * s) @ (k * s).transpose(-2, -1) / 2.0
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    expected = layer.out_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 5, 16))
    with torch.no_grad():
        torch.testing.assert_close(layer(x, is_causal=True), expected, atol=1e-5, rtol=1e-5)
        cache = layer.make_kv_cache(2, 5)
        steps = [layer(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(5)]
        torch.testing.assert_close(torch.cat(steps, 1), expected, atol=1e-5, rtol=1e-5)


class KeyPositionBias(PositionalPart):
    """A toy score bias: head h adds ``(h + 1) / 4 * key position`` to every score."""

    seam = "score_bias"

    def score_bias(self, query_positions, key_positions):
        key_positions = key_positions.expand(1, -1) if key_positions.dim() == 1 else key_positions
        slopes = torch.arange(1, 5, dtype=torch.float32) / 4  # (H,)
        return (slopes[:, None, None] * key_positions[:, None, None, :]).expand(
            -1, -1, query_positions.shape[-1], -1
        )  # (B or 1, H, L, S)


def _biased_reference(layer, x, key_positions, pad=None):
    """softmax(QK^T / sqrt(D) + (h+1)/4 * key position, causal, padding) V W^O, written out."""
    B, L, _ = x.shape
    q, k, v = F.linear(x, layer.in_proj.weight, layer.in_proj.bias).split([16, 8, 8], dim=-1)
    q = q.view(B, L, 4, 4).transpose(1, 2)
    k, v = (t.view(B, L, 2, 4).transpose(1, 2).repeat_interleave(2, dim=1) for t in (k, v))
    bias = (torch.arange(1, 5) / 4)[None, :, None, None] * key_positions[:, None, None, :]
    scores = q @ k.transpose(-2, -1) / 2.0 + bias
    scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    if pad is not None:
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
    return layer.out_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, 16))


@pytest.mark.parametrize("backend", ["math", "sdpa", "flex"])
def test_a_score_bias_reaches_every_backend_that_takes_one_and_the_cache(backend):
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4, 2, backend=backend, positions=KeyPositionBias()).eval()
    x = torch.randn(2, 5, 16)
    expected = _biased_reference(layer, x, torch.arange(5.0).expand(2, 5))
    with torch.no_grad():  # flex has no backward on the CPU
        torch.testing.assert_close(layer(x, is_causal=True), expected, atol=1e-5, rtol=1e-5)
        for static in (False, True):
            cache = layer.make_kv_cache(2, 5, static=static)
            steps = [layer(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(5)]
            torch.testing.assert_close(torch.cat(steps, 1), expected, atol=1e-5, rtol=1e-5)


def test_a_score_bias_sees_the_keys_own_positions_in_a_left_padded_cached_batch():
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4, 2, backend="math", positions=KeyPositionBias()).eval()
    x = torch.randn(2, 5, 16)
    pad = torch.tensor([[False] * 5, [True, True, False, False, False]])
    position_ids = (torch.cumsum(~pad, dim=1) - 1).clamp(min=0)  # row 1 starts at 0 after pad
    expected = _biased_reference(layer, x, position_ids.float(), pad)
    with torch.no_grad():
        full = layer(x, is_causal=True, key_padding_mask=pad, position_ids=position_ids)
        cache = layer.make_kv_cache(2, 5)
        steps = [
            layer(
                x[:, t : t + 1], is_causal=True, kv_cache=cache, key_padding_mask=pad[:, : t + 1],
                position_ids=position_ids[:, t : t + 1],
            )
            for t in range(5)
        ]  # fmt: skip
    for out in (full, torch.cat(steps, 1)):  # the padded queries of row 1 see no key
        torch.testing.assert_close(out[0], expected[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[1, 2:], expected[1, 2:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "backend", [n for n, b in BACKENDS.items() if not b.score_bias and b.package is None]
)
def test_a_backend_without_score_bias_refuses_it_by_name(backend):
    assert set(BACKENDS) - {n for n, b in BACKENDS.items() if b.score_bias} >= {"flash", "cudnn"}
    with pytest.raises(ValueError, match=f"backend '{backend}' takes no score bias"):
        MultiHeadAttention(16, 4, backend=backend, positions=KeyPositionBias())


def test_a_design_refuses_what_it_cannot_work_with_by_name_when_built():
    """HeadDesign.check: MLA's absorbed decoding cannot take keys turned by their positions
    (its own rotary_dim is the decoupled key), nor K/V heads shared by query heads."""
    from multihead.attention import RotaryPositions
    from multihead.attention.latent import LatentKV

    with pytest.raises(ValueError, match=r"'mla' takes no rotary positions in the layer \(Rot"):
        MultiHeadAttention(16, 4, design="mla", kv_latent_dim=8, positions=RotaryPositions(4))
    with pytest.raises(ValueError, match="'mla' has one K/V head per query head; got num_kv_h"):
        MultiHeadAttention(16, 4, 2, design=LatentKV(16, 4, 4, kv_latent_dim=8))


def test_the_separate_projection_layout_keeps_the_linears_and_computes_the_same():
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4, 2).eval()
    q_proj, k_proj, v_proj = (torch.nn.Linear(16, n) for n in (16, 8, 8))
    with torch.no_grad():
        for ours, theirs in zip(layer.in_proj.blocks(), (q_proj, k_proj, v_proj), strict=True):
            theirs.weight.copy_(ours)
        for ours, theirs in zip(
            layer.in_proj.blocks("bias"), (q_proj, k_proj, v_proj), strict=True
        ):
            theirs.bias.copy_(ours)
    x = torch.randn(2, 5, 16)
    expected = layer(x, is_causal=True)
    layer.in_proj = QKVProjection.from_linears(q_proj, k_proj, v_proj, 4, 2)
    assert (
        layer.in_proj.blocks()[1] is k_proj.weight and "in_proj.q_proj.weight" in layer.state_dict()
    )
    torch.testing.assert_close(layer(x, is_causal=True), expected, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="q_proj, k_proj must have 4 and 3 heads"):
        QKVProjection.from_linears(q_proj, k_proj, v_proj, 4, 3)


def test_the_import_graph_of_attention_has_no_cycle():
    """Every import between modules of ``attention/``, type-hint imports included."""
    graph = {}
    for path in sorted(ATTENTION.glob("*.py")):
        if path.stem == "__init__":
            continue
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "multihead.attention":
                edges |= {a.name for a in node.names}  # from multihead.attention import latent
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "multihead.attention."
            ):
                edges.add(node.module.rsplit(".", 1)[1])
        graph[path.stem] = edges & {p.stem for p in ATTENTION.glob("*.py")}
    done, stack = set(), []

    def visit(name):
        assert name not in stack, f"import cycle: {' -> '.join([*stack, name])}"
        if name in done:
            return
        stack.append(name)
        for other in graph[name]:
            visit(other)
        stack.pop()
        done.add(name)

    for name in graph:
        visit(name)
    assert importlib.import_module("multihead.attention.layer")


class OwnAttend(HeadDesign):
    """A design with its own attention of the heads, and no per-head outputs."""

    name = attribute = "own_attend"

    def attend(self, q, k, v, mask, call):
        return call.attend(2 * q, k, v, mask)


def test_head_analysis_refuses_a_design_without_per_head_outputs_by_name():
    layer = MultiHeadAttention(16, 4, design=OwnAttend())
    weights, source = torch.rand(1, 4, 3, 3), torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="'own_attend' gives no per-head outputs"):
        layer.head_outputs(weights, source)


def test_a_positional_part_names_itself_in_the_head_tag() -> None:
    """Runs of one head configuration with other positions get other run names, so
    compare.py does not pool them as seeds of one configuration."""
    from multihead.attention import ALiBi

    assert MultiHeadAttention(32, 4).head_tag == "mha4"
    assert MultiHeadAttention(32, 4, 2, rotary_dim=8).head_tag == "gqa4kv2-rope"
    assert MultiHeadAttention(32, 4, positions=ALiBi(4)).head_tag == "mha4-alibi"


class _Hooked(HeadDesign):
    """A design that changes the formula through the math kernel's hooks (sigmoid weights)."""

    name = attribute = "hooked"

    def __init__(self, e, h, g, *, bias, device=None, dtype=None):
        super().__init__()

    def on_weights(self, weights, scores, mask):
        return torch.sigmoid(scores)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_the_math_kernels_hooks_are_refused_on_another_backend_when_built(backend):
    """It ran the math path while the layer reported ``sdpa`` or ``flex``; then it raised at
    the first call. A design with a hook says so by having it: refused when built."""
    with pytest.raises(ValueError, match=rf"'hooked' runs on backend math only; got backend="
                       rf"{backend!r}: .*hooks \(on_weights\)"):  # fmt: skip
        MultiHeadAttention(16, 4, backend=backend, design=_Hooked(16, 4, 4, bias=True))
    math = MultiHeadAttention(16, 4, backend="math", design=_Hooked(16, 4, 4, bias=True))
    x = torch.randn(2, 3, 16)
    q, k, v = math.in_proj.qkv(x)  # (B, H, L, D): sigmoid(scores) V, by hand
    heads = torch.sigmoid(q @ k.transpose(-1, -2) * math.scale) @ v
    torch.testing.assert_close(math(x), math.out_proj(heads.transpose(1, 2).reshape(2, 3, 16)))


def test_a_design_without_attribute_is_named():
    """It failed with KeyError: 'module name can't be empty string ""'."""
    from multihead.attention import register_design

    class Nameless(_Hooked):
        name, attribute = "nameless", ""

    with pytest.raises(ValueError, match=r"head design 'nameless' \(.*Nameless\) needs a class"):
        register_design("nameless", Nameless)
    with pytest.raises(ValueError, match=r"head design 'nameless' .* got ''"):
        MultiHeadAttention(16, 4, backend="math", design=Nameless(16, 4, 4, bias=True))


# --------------------------------------------------------------------------- the interface
class SigmoidAttention(HeadDesign):
    """Sigmoid attention (Ramapuram et al., 2024): ``sigmoid(Q K^T / sqrt(D) - log n) V``, ``n``
    the key length. Cached decoding would give each step its own ``n``, the keys so far: the
    design says it refuses the cache."""

    name = attribute = "sigmoid"
    refuses_kv_cache = True

    def on_weights(self, weights, scores, mask):
        return torch.sigmoid(scores - math.log(scores.shape[-1]))


def test_a_design_that_refuses_the_cache_gets_none_in_self_attention():
    """Refused by name in self-attention; cross-attention's cache holds the whole memory,
    every key, so it is taken there and equals the full pass."""
    layer = MultiHeadAttention(16, 4, backend="math", design=SigmoidAttention()).eval()
    x, memory = torch.randn(2, 5, 16), torch.randn(2, 3, 16)
    q, k, v = layer.in_proj.qkv(x)  # (B, H, L, D): the formula by hand
    scores = q @ k.transpose(-1, -2) * layer.scale - math.log(5)
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    heads = torch.sigmoid(scores) @ v
    want = layer.out_proj(heads.transpose(1, 2).reshape(2, 5, 16))
    with torch.no_grad():
        torch.testing.assert_close(layer(x, is_causal=True), want)
        with pytest.raises(ValueError, match="'sigmoid' refuses a KV cache in self-attention"):
            layer(x[:, :1], is_causal=True, kv_cache=layer.make_kv_cache(2, 5))
        cache = layer.make_kv_cache(2, 3)
        steps = [layer(x[:, i : i + 1], memory, kv_cache=cache) for i in range(5)]
        torch.testing.assert_close(torch.cat(steps, 1), layer(x, memory))


class SeesTheCall(HeadDesign):
    """Records what each call shows a design: the queries' positions, the keys, the cache."""

    name = attribute = "sees_the_call"

    def __init__(self):
        super().__init__()
        self.seen = []

    def attend(self, q, k, v, mask, call):
        positions = None if call.positions is None else call.positions.tolist()
        self.seen.append((positions, k.shape[2], call.kv_cache is not None))
        return call.attend(q, k, v, mask)


@pytest.mark.parametrize("static", [False, True])
def test_a_design_sees_the_queries_positions_and_the_keys(static):
    layer = MultiHeadAttention(16, 4, design=SeesTheCall()).eval()
    x, memory = torch.randn(1, 4, 16), torch.randn(1, 3, 16)
    with torch.no_grad():
        layer(x, is_causal=True)
        cache = layer.make_kv_cache(1, 4, static=static)
        layer(x[:, :2], is_causal=True, kv_cache=cache)
        layer(x[:, 2:3], is_causal=True, kv_cache=cache)
        layer(x, memory)  # cross-attention: the queries' and keys' positions are unrelated
    S = 4 if static else None  # a static cache's keys are its whole buffers
    assert layer.design.seen == [
        ([0, 1, 2, 3], 4, False), ([0, 1], S or 2, True), ([2], S or 3, True), (None, 3, False)
    ]  # fmt: skip


class OwnRotary(HeadDesign):
    """A design with a rotary key of its own that takes ``rotary_dim`` and nothing else."""

    name = attribute = "own_rotary"

    def __init__(self, e, h, g, *, bias, device=None, dtype=None, rotary_dim=None):
        super().__init__()
        self.rotary_dim = rotary_dim

    @property
    def options(self):
        return {"rotary_dim": self.rotary_dim}


def test_a_design_that_takes_rotary_dim_gets_only_the_rotary_keywords_it_takes():
    """The layer handed rope_theta and rope_interleaved to any design taking rotary_dim:
    TypeError for one without them."""
    from multihead.attention import DESIGNS, register_design

    register_design(OwnRotary.name, OwnRotary)
    try:
        layer = MultiHeadAttention(16, 4, design="own_rotary", rotary_dim=4)
        assert layer.design.rotary_dim == 4 and layer.positions is None
        with pytest.raises(ValueError, match="'own_rotary' takes rotary_dim but no rope_theta; "
                           "got rope_theta=500000.0"):  # fmt: skip
            MultiHeadAttention(16, 4, design="own_rotary", rotary_dim=4, rope_theta=500000.0)
    finally:
        del DESIGNS[OwnRotary.name]


def test_an_mla_instance_tells_the_layer_its_widths():
    """qk_head_dim, v_head_dim and q_latent_dim were read from the keywords alone: an instance
    got a Q projection E / H wide per head and failed at the first call (a shape error)."""
    from multihead.attention.latent import LatentKV

    options = dict(kv_latent_dim=8, qk_head_dim=2, v_head_dim=6, q_latent_dim=12, rotary_dim=4)
    torch.manual_seed(0)
    by_name = MultiHeadAttention(16, 4, design="mla", **options).eval()
    instance = MultiHeadAttention(16, 4, design=LatentKV(16, 4, 4, **options)).eval()
    assert instance.in_proj.weight.shape == (4 * 2, 12) and instance.out_proj.in_features == 24
    instance.load_state_dict(by_name.state_dict())
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(instance(x, is_causal=True), by_name(x, is_causal=True))


def test_no_file_compares_a_designs_name_or_checks_its_class_outside_its_own():
    """A design's name and class stay home: elsewhere the code asks the design (its hooks,
    options, conversions) or its positional part (its seam). analysis/ is not searched: its
    "diff" is a table column's kind, its "mla" a conversion method."""
    import sys

    from multihead.attention import DESIGNS, ALiBi

    owners = {name: Path(sys.modules[cls.__module__].__file__) for name, cls in DESIGNS.items()}
    classes = {cls.__name__: path for cls, path in ((c, owners[n]) for n, c in DESIGNS.items())}
    classes["ALiBi"] = Path(sys.modules[ALiBi.__module__].__file__)

    def strings(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value
        for element in getattr(node, "elts", ()):
            yield from strings(element)

    found = []
    package = ATTENTION.parent
    for path in sorted(package.rglob("*.py")):
        if path.parent.name == "analysis":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                names = {s for part in (node.left, *node.comparators) for s in strings(part)}
                found += [f"{path.name}:{node.lineno} == {n!r}" for n in names & set(owners)
                          if owners[n] != path]  # fmt: skip
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                found += [f"{path.name}:{node.lineno} isinstance {n}" for n in names & set(classes)
                          if classes[n] != path]  # fmt: skip
    assert found == []


def test_no_file_reads_a_designs_internals_outside_its_own():
    """Outside its file a design is read through its interface: the members of HeadDesign
    (those it defines and the optional ones its docstring names) and the designs' public
    methods and properties (MLA's load_factors, linear_kv, mha_kv), never what a design sets
    on itself (its parameters' modules, its sizes: down, up, k_rope, qk_head_dim, ...). A
    design is ``x.design``, ``x.<its attribute>`` (``layer.kv_latent``) or a name given one."""
    import re
    import sys

    from multihead.attention import DESIGNS

    owners = {Path(sys.modules[cls.__module__].__file__) for cls in DESIGNS.values()}
    interface = {n for cls in DESIGNS.values() for n in dir(cls) if not n.startswith("_")}
    interface |= set(re.findall(r"``(\w+)", HeadDesign.__doc__))  # kind, cache_layout, ...
    holders = {"design"} | {cls.attribute for cls in DESIGNS.values()}
    # Still reaching in, for want of a seam: DeepSeek's swap puts HF's own norm modules and
    # low-rank query into the latent and drops its rotary query's bias, and keeps HF's
    # frozen parameters frozen. (DiffLlama's lambda vectors now go through its HF layout.)
    known = {("deepseek.py", "from_deepseek")}

    def is_design(node, bound=frozenset()) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr in holders) or (
            isinstance(node, ast.Name) and node.id in bound
        )

    found, reached = [], set()
    for path in sorted(ATTENTION.parent.rglob("*.py")):
        if path in owners:
            continue
        tree = ast.parse(path.read_text())
        for function in (f for top in tree.body
                         for f in (top.body if isinstance(top, ast.ClassDef) else [top])
                         if isinstance(f, ast.FunctionDef)):  # fmt: skip
            bound = set()  # names given a design in it: latent = layer.design
            for node in ast.walk(function):
                for target in node.targets if isinstance(node, ast.Assign) else ():
                    pairs = [(target, node.value)]
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs = zip(target.elts, node.value.elts, strict=True)
                    bound |= {t.id for t, v in pairs if isinstance(t, ast.Name) and is_design(v)}
            for node in ast.walk(function):
                if isinstance(node, ast.Attribute) and is_design(node.value, bound):
                    name = node.attr
                elif (
                    isinstance(node, ast.Call)
                    and getattr(node.func, "id", "") in ("getattr", "setattr", "hasattr")
                    and is_design(node.args[0], bound)
                ):
                    what = node.args[1]  # a name computed at run time: never the interface
                    name = what.value if isinstance(what, ast.Constant) else ast.unparse(what) + "?"
                else:
                    continue
                if name in interface:
                    continue
                if (path.name, function.name) in known:
                    reached.add((path.name, function.name))
                else:
                    found.append(f"{path.name}:{node.lineno} ({function.name}) reads {name}")
    assert found == []
    assert reached == known  # one that no longer reaches in leaves the list
