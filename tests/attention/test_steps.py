"""The textbook steps as public functions, the head-design interface and the positional hook."""

import ast
from pathlib import Path

import torch
import torch.nn.functional as F

import multihead.attention
from multihead import MultiHeadAttention
from multihead.attention import HeadDesign

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
        "head_gate": {"top_k_heads": 2},
        "head_mix": {"head_mixing": "group_mlp"},
        "kv_latent": {"kv_latent_dim": 8},
    }
    for attribute, options in designs.items():
        layer = MultiHeadAttention(16, 4, **options)
        assert isinstance(layer.design, HeadDesign) and layer.design.attribute == attribute
        assert all(
            k.startswith(("in_proj.", "out_proj.", f"{attribute}.")) for k in layer.state_dict()
        )


class ScaleByPosition:
    """A toy positional part: Q and K at position p scaled by 1 + p / 10."""

    def __call__(self, x, positions):
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
