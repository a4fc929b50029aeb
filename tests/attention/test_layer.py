"""The layer's projections, conversions and argument checks (CPU, tiny sizes)."""

import doctest
import re

import pytest
import torch
from torch import nn

import multihead.attention.kv_cache
import multihead.attention.layer
import multihead.attention.sparse
from multihead import MultiHeadAttention
from multihead.attention import from_torch, with_kv_heads
from multihead.attention.rotary import RotaryPositions

E, H = 32, 4
B, L, S = 2, 6, 9


# --------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("num_kv_heads", [None, 4, 2, 1])
@pytest.mark.parametrize("bias", [True, False])
def test_parameter_counts(num_kv_heads, bias):
    layer = MultiHeadAttention(E, H, num_kv_heads, bias=bias)
    G, D = num_kv_heads or H, E // H
    weights = E * E + 2 * E * G * D + E * E
    biases = (E + 2 * G * D + E) if bias else 0
    assert sum(p.numel() for p in layer.parameters()) == weights + biases
    if num_kv_heads in (None, H):
        assert weights == 4 * E * E


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_projection_init_scale_does_not_depend_on_kv_heads(num_kv_heads):
    # Every variant draws its Q/K/V weights from MHA's Xavier bound, U(+-sqrt(6 / 4E)), so
    # that MHA, GQA and MQA differ only in K/V sharing. Xavier on the smaller GQA/MQA stack
    # would give a bound of sqrt(6 / (2E + 2GD)): 27% larger for MQA at 4 heads.
    torch.manual_seed(0)
    layer = MultiHeadAttention(128, 4, num_kv_heads)
    weight = layer.in_proj.weight.detach()
    bound = (6 / (4 * 128)) ** 0.5
    assert weight.abs().max() <= bound
    assert weight.abs().max() > 0.99 * bound
    # a uniform on [-b, b] has standard deviation b / sqrt(3)
    assert weight.std().item() == pytest.approx(bound / 3**0.5, rel=0.03)


def test_mha_init_matches_xavier_on_the_stacked_projection():
    # MHA keeps torch.nn.MultiheadAttention's init exactly (same random draws).
    torch.manual_seed(0)
    layer = MultiHeadAttention(E, H)
    torch.manual_seed(0)
    in_proj, out_proj = nn.Linear(E, 3 * E), nn.Linear(E, E)
    nn.init.xavier_uniform_(in_proj.weight)
    assert torch.equal(layer.in_proj.weight, in_proj.weight)
    assert torch.equal(layer.out_proj.weight, out_proj.weight)


def test_kind_names():
    assert MultiHeadAttention(E, H).head_config["kind"] == "mha"
    assert MultiHeadAttention(E, H, 2).head_config["kind"] == "gqa"
    assert MultiHeadAttention(E, H, 1).head_config["kind"] == "mqa"
    assert MultiHeadAttention(E, 1, 1).head_config["kind"] == "mha"  # one head: nothing shared


# --------------------------------------------------------------------------- the plain path
def _statement_lines(path: str) -> dict[int, int]:
    """Each line of ``path`` -> the first line of the innermost statement holding it (of a
    compound statement, its header only): lines as coverage.py counts them, a statement over
    several lines once, however it is formatted."""
    import ast

    first: dict[int, tuple[int, int]] = {}  # line -> (first line, span) of the innermost
    for node in ast.walk(ast.parse(open(path).read())):
        if not isinstance(node, ast.stmt):
            continue
        bodies = [getattr(node, f, None) for f in ("body", "orelse", "finalbody", "handlers")]
        end = min([node.end_lineno] + [b[0].lineno - 1 for b in bodies if b])
        for line in range(node.lineno, end + 1):
            if line not in first or first[line][1] > end - node.lineno:
                first[line] = (node.lineno, end - node.lineno)
    return {line: start for line, (start, _) in first.items()}


def test_the_plain_path_executes_at_most_50_lines_of_the_package():
    """A plain MHA ``sdpa`` forward reads as one function with a few calls (issue 65: 85
    lines in 5 files, through a placeholder design; torchtune's is about 35): the lines of
    ``src/multihead`` that ``sys.settrace`` sees run in the second call (the first also checks
    the backend, once per kind of input), counted as coverage.py counts lines."""
    import sys
    from pathlib import Path

    package = str(Path(multihead.attention.layer.__file__).parents[1])
    layer, x = MultiHeadAttention(64, 4), torch.randn(2, 5, 64)
    layer(x)
    lines = set()

    def trace(frame, event, arg):
        if not frame.f_code.co_filename.startswith(package):
            return None
        if event == "line":
            lines.add((frame.f_code.co_filename, frame.f_lineno))
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        layer(x)
    finally:
        sys.settrace(previous)
    owners = {path: _statement_lines(path) for path, _ in lines}
    statements = {(path, owners[path].get(line, line)) for path, line in lines}
    files = sorted({Path(path).name for path, _ in statements})
    where = {f: sorted(n for p, n in statements if Path(p).name == f) for f in files}
    assert len(statements) <= 50, f"{len(statements)} lines: {where}"
    assert "designs.py" not in files  # no hop through a design the plain layer does not have


# --------------------------------------------------------------------------- from_torch
@pytest.mark.parametrize("backend", ["math", "sdpa", "flash"])
@pytest.mark.parametrize(
    "masks", ["none", "padding", "bool", "float", "float+padding", "causal_float"]
)
def test_from_torch_matches_nn_multihead_attention_in_training(backend, masks):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=True).train()
    nn.init.normal_(ref.in_proj_bias)
    nn.init.normal_(ref.out_proj.bias)
    layer = from_torch(ref, backend=backend)
    assert layer.training
    x, mem = torch.randn(B, L, E, requires_grad=True), torch.randn(B, S, E, requires_grad=True)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, -3:] = True
    bool_mask = torch.rand(L, S) < 0.3
    bool_mask[:, 0] = False
    kwargs = {
        "none": {},
        "padding": {"key_padding_mask": pad},
        "bool": {"attn_mask": bool_mask},
        "float": {"attn_mask": torch.randn(L, S)},
        "float+padding": {"attn_mask": torch.randn(L, S), "key_padding_mask": pad},
    }.get(masks)
    if masks == "causal_float":  # self-attention with nn.Transformer's float causal mask
        causal = nn.Transformer.generate_square_subsequent_mask(L)
        expected, _ = ref(x, x, x, attn_mask=causal, need_weights=False)
        got = layer(x, attn_mask=causal)
        got_causal = layer(x, is_causal=True)
        torch.testing.assert_close(got_causal, expected, atol=1e-5, rtol=1e-4)
        inputs = [x]
    else:
        expected, _ = ref(x, mem, mem, need_weights=False, **kwargs)
        got = layer(x, mem, **kwargs)
        inputs = [x, mem]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    grad_out = torch.randn_like(got)
    ref_grads = torch.autograd.grad(expected, [*inputs, ref.in_proj_weight], grad_out)
    got_grads = torch.autograd.grad(got, [*inputs, layer.in_proj.weight], grad_out)
    for g, g_ref in zip(got_grads, ref_grads, strict=True):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-4)


def test_from_torch_need_weights_match():
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, batch_first=True)
    layer = from_torch(ref)
    x = torch.randn(B, L, E)
    out_ref, w_ref = ref(x, x, x, need_weights=True, average_attn_weights=False)
    out, w = layer(x, need_weights=True)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-4)


# --------------------------------------------------------------------------- GQA / MQA
@pytest.mark.parametrize("num_kv_heads", [2, 1])
@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_gqa_with_repeated_kv_weights_equals_mha(num_kv_heads, backend):
    torch.manual_seed(0)
    gqa = MultiHeadAttention(E, H, num_kv_heads, backend=backend)
    mha = MultiHeadAttention(E, H, backend=backend)
    D, G = E // H, num_kv_heads
    with torch.no_grad():
        for name in ("weight", "bias"):
            q, k, v = getattr(gqa.in_proj, name).split([E, G * D, G * D])

            def repeat(t):  # (G*D, ...) -> (H*D, ...): each K/V head serves H/G query heads
                return t.reshape(G, 1, D, *t.shape[1:]).expand(G, H // G, D, *t.shape[1:])

            full = torch.cat(
                [q, repeat(k).reshape(H * D, *q.shape[1:]), repeat(v).reshape(H * D, *q.shape[1:])]
            )
            getattr(mha.in_proj, name).copy_(full)
        mha.out_proj.load_state_dict(gqa.out_proj.state_dict())
    x = torch.randn(B, L, E)
    torch.testing.assert_close(gqa(x, is_causal=True), mha(x, is_causal=True), atol=1e-5, rtol=1e-4)


def test_with_kv_heads_mean_pools_by_hand():
    torch.manual_seed(0)
    mha = MultiHeadAttention(E, H)
    nn.init.normal_(mha.in_proj.bias)
    gqa = with_kv_heads(mha, 2)
    D = E // H
    w, b = mha.in_proj.weight, mha.in_proj.bias
    k_heads = [w[E + h * D : E + (h + 1) * D] for h in range(H)]
    v_heads = [w[2 * E + h * D : 2 * E + (h + 1) * D] for h in range(H)]
    kb = [b[E + h * D : E + (h + 1) * D] for h in range(H)]
    expected_w = torch.cat(
        [w[:E]]
        + [(k_heads[0] + k_heads[1]) / 2, (k_heads[2] + k_heads[3]) / 2]
        + [(v_heads[0] + v_heads[1]) / 2, (v_heads[2] + v_heads[3]) / 2]
    )
    torch.testing.assert_close(gqa.in_proj.weight, expected_w)
    torch.testing.assert_close(
        gqa.in_proj.bias[E : E + 2 * D], torch.cat([(kb[0] + kb[1]) / 2, (kb[2] + kb[3]) / 2])
    )
    torch.testing.assert_close(gqa.out_proj.weight, mha.out_proj.weight)
    mqa = with_kv_heads(mha, 1)
    torch.testing.assert_close(mqa.in_proj.weight[E : E + D], torch.stack(k_heads).mean(0))
    assert mqa.num_kv_heads == 1 and sum(p.numel() for p in mqa.parameters()) < sum(
        p.numel() for p in gqa.parameters()
    )


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_with_kv_heads_is_exact_when_heads_in_a_group_are_identical(num_kv_heads):
    torch.manual_seed(0)
    mha = MultiHeadAttention(E, H)
    D, r = E // H, H // num_kv_heads
    with torch.no_grad():
        for t in (mha.in_proj.weight, mha.in_proj.bias):
            for start in (E, 2 * E):  # K and V rows
                heads = t[start : start + E].view(num_kv_heads, r, D, *t.shape[1:])
                heads.copy_(heads[:, :1].expand_as(heads))
    converted = with_kv_heads(mha, num_kv_heads)
    x, mem = torch.randn(B, L, E), torch.randn(B, S, E)
    assert torch.equal(converted(x, is_causal=True), mha(x, is_causal=True))
    assert torch.equal(converted(x, mem), mha(x, mem))


def test_with_kv_heads_rejects_a_non_divisor():
    with pytest.raises(ValueError, match=r"4 K/V heads into 3"):
        with_kv_heads(MultiHeadAttention(E, H), 3)


def test_with_kv_heads_refuses_the_count_the_layer_has():
    """It returned a copy that differed only in its in_proj layout: stacked, where a swapped
    HF layer's is separate, so that save_pretrained refused the model (issue 84)."""
    layer = MultiHeadAttention(E, H, num_kv_heads=2)
    message = "with_kv_heads(2) would leave 'gqa4kv2' as it is: it has 2 K/V heads already"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        with_kv_heads(layer, 2)


# --------------------------------------------------------------------------- masks
@pytest.mark.parametrize("backend", ["math", "sdpa", "flash"])
@pytest.mark.parametrize("num_kv_heads", [None, 1])
def test_padded_keys_are_ignored(backend, num_kv_heads):
    torch.manual_seed(0)
    layer = MultiHeadAttention(E, H, num_kv_heads, backend=backend)
    x, mem = torch.randn(B, L, E), torch.randn(B, S, E)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[0, -4:] = True
    pad[1, -1:] = True
    changed = mem.clone()
    changed[pad] = torch.randn(int(pad.sum()), E) * 100
    assert torch.equal(layer(x, mem, key_padding_mask=pad), layer(x, changed, key_padding_mask=pad))
    # Self-attention: the padded positions' outputs may change, the others must not.
    y1, y2 = layer(mem, key_padding_mask=pad), layer(changed, key_padding_mask=pad)
    torch.testing.assert_close(y1[~pad], y2[~pad], atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- errors
def test_embed_dim_not_divisible_by_heads():
    with pytest.raises(ValueError, match=r"embed_dim \(30\).*num_heads \(4\)"):
        MultiHeadAttention(30, 4)


@pytest.mark.parametrize(
    ("embed_dim", "num_heads", "pattern"),
    [(E, 0, "num_heads must be >= 1, got 0"), (0, H, "embed_dim must be >= 1, got 0")],
)
def test_embed_dim_and_heads_must_be_positive(embed_dim, num_heads, pattern):
    with pytest.raises(ValueError, match=pattern):
        MultiHeadAttention(embed_dim, num_heads)


def test_heads_not_divisible_by_kv_heads():
    with pytest.raises(ValueError, match=r"num_heads \(4\).*num_kv_heads \(3\)"):
        MultiHeadAttention(E, H, 3)


def test_key_value_embed_size_mismatch():
    layer = MultiHeadAttention(E, H)
    with pytest.raises(ValueError, match=r"E=32.*\(2, 9, 16\)"):
        layer(torch.randn(B, L, E), torch.randn(B, S, 16))


def test_query_embed_size_mismatch():
    with pytest.raises(ValueError, match=r"E=32.*\(2, 6, 16\)"):
        MultiHeadAttention(E, H)(torch.randn(B, L, 16))


@pytest.mark.parametrize("shape", [(L, S + 1), (3, 1, L, L), (H + 1, L, L)])
def test_attn_mask_that_does_not_broadcast(shape):
    layer = MultiHeadAttention(E, H)
    pattern = rf"attn_mask of shape \({', '.join(map(str, shape))}\).*\(2, 4, 6, 6\)"
    with pytest.raises(ValueError, match=pattern):
        layer(torch.randn(B, L, E), attn_mask=torch.zeros(shape, dtype=torch.bool))


def test_key_padding_mask_wrong_shape():
    layer = MultiHeadAttention(E, H)
    with pytest.raises(ValueError, match=r"\(2, 9\).*got \(2, 8\)"):
        layer(
            torch.randn(B, L, E),
            torch.randn(B, S, E),
            key_padding_mask=torch.zeros(B, 8, dtype=torch.bool),
        )


def test_bad_dropout():
    with pytest.raises(ValueError, match=r"1.5"):
        MultiHeadAttention(E, H, dropout=1.5)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: MultiHeadAttention(E, H, bias="no"), "bias must be a bool, got 'no'"),
        (lambda: MultiHeadAttention(E, H, bias=0), "bias must be a bool, got 0"),
        (
            lambda: MultiHeadAttention(E, H, rotary_dim=8, rope_interleaved="false"),
            "rope_interleaved must be a bool, got 'false'",
        ),
        (
            lambda: MultiHeadAttention(E, H, design="mla", kv_latent_dim=8, kv_latent_norm="no"),
            "kv_latent_norm must be a bool, got 'no'",
        ),
        (lambda: RotaryPositions(8, interleaved="no"), "rope_interleaved must be a bool, got 'no'"),
    ],
    ids=["bias-str", "bias-int", "rope_interleaved", "kv_latent_norm", "rotary-part"],
)
def test_a_switch_takes_a_bool_only(build, message):
    """``bias="no"`` built a layer with biases (issue 84): a switch is True or False."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build()


# --------------------------------------------------------------------------- docs
@pytest.mark.parametrize(
    "module", [multihead.attention.layer, multihead.attention.kv_cache, multihead.attention.sparse]
)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0
