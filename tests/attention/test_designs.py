"""The head-design registry (designs.py): a design named by import path or by an installed
package's entry point, its options given only with its name, and the ``head_config`` that
builds it again.

Each test writes its design module into its own directory, put on ``sys.path``; the formulas
of the package's own designs are tested in test_head_designs.py and their files' tests.
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from multihead import MultiHeadAttention
from multihead.attention import DESIGNS, HeadDesign, register_design, with_kv_heads

E, H = 16, 4

# Q scaled by `factor` before the kernel: softmax(factor Q K^T / sqrt(D)) V on any backend.
SCALED = """
from multihead.attention import HeadDesign, register_design


class Scaled(HeadDesign):
    name, attribute = "scaled", "scaled"
    conversions = frozenset({"with_kv_heads"})

    def __init__(self, embed_dim, num_heads, num_kv_heads, *, bias, device=None, dtype=None,
                 factor: float = 1.0):
        super().__init__()
        self.factor = factor

    @property
    def options(self):
        return {"factor": self.factor}

    def attend(self, q, k, v, mask, call):
        return call.attend(q * self.factor, k, v, mask)


def helper():
    pass
"""


@pytest.fixture
def outside(tmp_path, monkeypatch, request):
    """``write(module, source)``: a module of that name in a directory on ``sys.path``, gone
    (with the names registered meanwhile) after the test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    registered = dict(DESIGNS)
    written = []

    def write(module: str, source: str = SCALED) -> str:
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        written.append(module)
        return module

    yield write
    for module in written:
        sys.modules.pop(module, None)
    DESIGNS.clear()
    DESIGNS.update(registered)


def q_scaled_plain(layer: MultiHeadAttention, factor: float) -> MultiHeadAttention:
    """The plain layer with ``layer``'s weights and its Q projection times ``factor``."""
    plain = MultiHeadAttention(E, H, layer.num_kv_heads)
    plain.load_state_dict(layer.state_dict())
    with torch.no_grad():
        for block in (plain.in_proj.blocks("weight")[0], plain.in_proj.blocks("bias")[0]):
            block.mul_(factor)
    return plain


def test_a_design_by_import_path_builds_computes_and_is_rebuilt_from_its_path(outside):
    """It was "unknown head design"; its head_config names the path, so a conversion (and a
    checkpoint's config) builds it in a process where only the path makes it known."""
    module = outside("outside_scaled")
    layer = MultiHeadAttention(E, H, design=f"{module}.Scaled", factor=2.0)
    x = torch.randn(2, 5, E)
    torch.testing.assert_close(
        layer(x, is_causal=True), q_scaled_plain(layer, 2.0)(x, is_causal=True)
    )
    assert layer.head_config == {
        "kind": "mha", "num_heads": H, "num_kv_heads": H,
        "design": f"{module}.Scaled", "factor": 2.0,
    }  # fmt: skip
    pooled = with_kv_heads(layer, 2)
    assert type(pooled.design).__name__ == "Scaled" and pooled.design.factor == 2.0
    assert pooled.head_config["design"] == f"{module}.Scaled"


def test_a_design_by_path_records_its_path_though_its_module_registers_a_name(outside):
    """A fresh process knows the path, not the name the module registers when imported."""
    module = outside("outside_self_registered", SCALED + '\nregister_design("scaled", Scaled)\n')
    layer = MultiHeadAttention(E, H, design=f"{module}.Scaled")
    assert DESIGNS["scaled"] is type(layer.design)
    assert layer.head_config["design"] == f"{module}.Scaled"


def test_an_installed_packages_entry_point_registers_its_design_when_first_named(outside, tmp_path):
    module = outside("outside_entry_point")
    dist = tmp_path / "outside_designs-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: outside-designs\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        f"[multihead.designs]\nep_scaled = {module}:Scaled\nep_broken = {module}:missing\n"
    )
    assert "ep_scaled" not in DESIGNS
    layer = MultiHeadAttention(E, H, design="ep_scaled", factor=0.5)
    assert DESIGNS["ep_scaled"] is type(layer.design) and layer.design.factor == 0.5
    assert layer.head_config["design"] == "ep_scaled"
    with pytest.raises(ValueError, match=r"'ep_broken': importing entry point .*:missing"):
        MultiHeadAttention(E, H, design="ep_broken")


@pytest.mark.parametrize(
    "design, message",
    [
        ("no_such_package_x.Design", "'no_such_package_x.Design': no module 'no_such_package_x'"),
        ("{module}.Missing", "'{module}.Missing': {module} has no attribute 'Missing'"),
        ("{module}.helper", "'{module}.helper' is <function helper"),
        ("{module}.Scaled.attend", "is <function Scaled.attend"),
        ("{broken}.Design", "importing module {broken} failed: ModuleNotFoundError: No module"),
        ("{failing}.Design", "importing module {failing} failed: RuntimeError: no GPU here"),
        ("sigmoid", "unknown head design 'sigmoid'; registered: diff, mla, "),
    ],
)
def test_a_design_that_cannot_be_loaded_is_one_line_naming_it(outside, design, message):
    names = {
        "module": outside("outside_loadable"),
        "broken": outside("outside_broken", "import not_installed_dependency_x\n"),
        "failing": outside("outside_failing", "raise RuntimeError('no GPU here\\nsecond line')\n"),
    }
    with pytest.raises(ValueError) as error:
        MultiHeadAttention(E, H, design=design.format(**names))
    assert message.format(**names) in str(error.value) and "\n" not in str(error.value)


class SharedHeads(HeadDesign):
    """A design of one option whose default is not 0; it computes nothing of its own."""

    name = attribute = "shared3"
    conversions = frozenset({"with_kv_heads"})

    def __init__(self, embed_dim, num_heads, num_kv_heads, *, bias, device=None, dtype=None,
                 num_shared_heads: int = 3) -> None:  # fmt: skip
        super().__init__()
        self.num_shared = num_shared_heads

    @property
    def options(self) -> dict[str, int]:
        return {"num_shared_heads": self.num_shared}


def test_an_option_is_what_its_design_gets_even_another_designs_off_value(outside):
    """0 was dropped as "off" because MoH's default is 0, so this design silently got 3."""
    register_design("shared3", SharedHeads)
    layer = MultiHeadAttention(E, H, design="shared3", num_shared_heads=0)
    assert layer.design.num_shared == 0 and layer.head_config["num_shared_heads"] == 0


class Nameless(HeadDesign):
    """No options of its own: its options, the interface's default, leave out its name."""

    name = attribute = "nameless"
    conversions = frozenset({"with_kv_heads"})

    def __init__(self, embed_dim, num_heads, num_kv_heads, *, bias, device=None, dtype=None):
        super().__init__()


class WrongOption(SharedHeads):
    name = attribute = "wrong_option"

    @property
    def options(self) -> dict[str, object]:
        return {"design": self.name, "num_shared_heads": self.num_shared}


class Required(SharedHeads):
    name = attribute = "required"

    def __init__(self, embed_dim, num_heads, num_kv_heads, *, bias, device=None, dtype=None,
                 width: int) -> None:  # fmt: skip
        super().__init__(embed_dim, num_heads, num_kv_heads, bias=bias)

    options = HeadDesign.options


def test_head_config_names_the_design_that_options_leaves_out(outside):
    """with_kv_heads rebuilt the layer without a design: AttributeError: 'NoneType' object
    has no attribute 'load_state_dict'."""
    register_design("nameless", Nameless)
    layer = MultiHeadAttention(E, H, design="nameless")
    assert layer.head_config["design"] == "nameless"
    assert type(with_kv_heads(layer, 2).design) is Nameless


@pytest.mark.parametrize(
    "design, message",
    [
        (WrongOption(E, H, H, bias=True), r"options property names design, which its constr"),
        (Required(E, H, H, bias=True, width=2), r"leaves out width, which its constructor needs"),
    ],
    ids=["wrong_option", "required"],
)
def test_options_that_would_not_build_the_design_again_are_refused_when_built(design, message):
    with pytest.raises(ValueError, match=rf"head design '{design.name}' .*{message}"):
        MultiHeadAttention(E, H, design=design)


class Optionless(SharedHeads):
    """Takes an option, and keeps the interface's options, which return none."""

    name = attribute = "optionless"
    options = HeadDesign.options


class Forgetful(SharedHeads):
    """Its own options property, which leaves out its one option (default 3)."""

    name = attribute = "forgetful"

    @property
    def options(self) -> dict[str, int]:
        return {}


def test_a_design_whose_options_are_the_interfaces_is_refused_when_registered(outside):
    """It built without a word, and its head_config rebuilt it with its defaults."""
    with pytest.raises(ValueError, match=r"'optionless' \(Optionless\) takes option "
                       r"num_shared_heads but has no options property of its own"):  # fmt: skip
        register_design("optionless", Optionless)
    module = outside("outside_optionless", SCALED.replace("    @property\n    def options(self):"
                     "\n        return {\"factor\": self.factor}\n", ""))  # fmt: skip
    with pytest.raises(ValueError, match=r"'scaled' \(Scaled\) takes option factor but has no"):
        MultiHeadAttention(E, H, design=f"{module}.Scaled")


def test_a_design_built_with_an_option_its_options_leave_out_is_refused_by_name(outside):
    """At its default the option may be left out (the default builds it again); set to
    anything else it would be lost from head_config and from the run's tag."""
    register_design("forgetful", Forgetful)
    assert MultiHeadAttention(E, H, design="forgetful", num_shared_heads=3).design.num_shared == 3
    with pytest.raises(ValueError, match=r"'forgetful' \(Forgetful\): its options property "
                       r"leaves out num_shared_heads=1, which is not the default"):  # fmt: skip
        MultiHeadAttention(E, H, design="forgetful", num_shared_heads=1)


def test_runs_of_two_settings_of_an_option_get_two_tags(outside):
    """Both were enc-mha4-shared3_..., so compare.py pooled two models as seeds of one; the
    default, given or not, is one model and one tag."""
    from helpers.models import tiny_model

    register_design("shared3", SharedHeads)

    def run_tag(**options) -> str:
        design = {"design": "shared3", "design_options": options}
        return tiny_model(attention={"num_heads": H, **design}).head_tag

    assert (
        run_tag()
        == run_tag(num_shared_heads=3)
        == "_".join(f"{part}-mha4-shared3" for part in ("enc", "dec", "cross")) + "_sdpa"
    )
    assert len({run_tag(), run_tag(num_shared_heads=1), run_tag(num_shared_heads=2)}) == 3


# Each built-in design at a setting where every option matters (MLA with its rotary key),
# and for each of its constructor's options a value that computes differently. A new option
# without an entry fails the test: its tag must tell it apart, or the entry says why not.
TAG_SETTINGS = {
    "mla": (
        {"kv_latent_dim": 16, "rotary_dim": 4},
        {"qk_head_dim": 2, "v_head_dim": 2, "softmax_scale": 0.5, "kv_latent_dim": 8,
         "kv_latent_norm": True, "rotary_dim": 8, "rope_theta": 500.0, "rope_interleaved": True,
         "rope_inv_freq": [0.5, 0.25], "rope_kv_heads": 2, "q_latent_dim": 8},
    ),
    "moh": ({"top_k_heads": 2}, {"top_k_heads": 1, "num_shared_heads": 1}),
    "talking_heads": ({"backend": "math"}, {}),
    "group_mlp": ({}, {"mixing_groups": 4}),
    "head_attention": ({}, {}),
    "diff": ({}, {"lambda_init": 0.5, "norm_eps": 0.5}),
}  # fmt: skip
BUILT_IN = sorted(n for n, c in DESIGNS.items() if c.__module__.startswith("multihead."))


@pytest.mark.parametrize("design", BUILT_IN)
def test_each_option_of_a_design_that_computes_differently_changes_its_tag(design):
    """docs/reuse.md: two settings that compute differently get two tags (compare.py pools
    runs of one tag as seeds of one model). MLA's widths and scale (qk_head_dim, v_head_dim,
    softmax_scale) and its rotary base, pairing and frequencies were left out of its tag;
    at the defaults the tag is unchanged (``mla4r16``, ``mha4-diff``: kept runs still pool)."""
    from multihead.attention.designs import _options

    base, varied = TAG_SETTINGS[design]
    assert varied.keys() == _options(DESIGNS[design]).keys()  # every option has a value
    x = torch.randn(2, 5, E)

    def built(**change):
        layer = MultiHeadAttention(E, H, design=design, **{**base, **change}).eval()
        torch.manual_seed(0)
        with torch.no_grad():  # no part at its identity start (group_mlp's zero rows)
            for p in layer.parameters():
                p.normal_(0, 0.5)
        return layer.head_tag, layer(x, is_causal=True)

    tag, out = built()
    for name, value in varied.items():
        other_tag, other_out = built(**{name: value})
        assert not torch.allclose(out, other_out), f"{name}={value!r} computes the same"
        assert other_tag != tag, f"{design}: {name}={value!r} keeps the tag {tag}"


def test_the_layers_rotary_options_change_its_tag():
    """The layer's own rotary part (``rotary_dim``, ``rope_theta``, ``rope_interleaved``) was
    ``-rope`` at every setting; rotating every feature at base 10,000 keeps ``-rope``."""
    x = torch.randn(2, 5, E)

    def built(**rotary):
        torch.manual_seed(0)
        layer = MultiHeadAttention(E, H, **rotary).eval()
        return layer.head_tag, layer(x, is_causal=True)

    tag, out = built(rotary_dim=4)
    assert tag == "mha4-rope" == built(rotary_dim=4, rope_theta=10000.0)[0]  # D = 4: every one
    tags = {tag}
    for change in ({"rotary_dim": 2}, {"rope_theta": 500.0}, {"rope_interleaved": True}):
        other_tag, other_out = built(**{"rotary_dim": 4, **change})
        assert not torch.allclose(out, other_out) and other_tag not in tags, change
        tags.add(other_tag)
    assert built(rotary_dim=2)[0] == "mha4-rope2"
