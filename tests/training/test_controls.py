"""The comparison's controls as presets (issue 83): parameter-matched GQA, MQA and MLA within
1% of MHA's parameters, counted on a separately built MHA model; the positions and width
controls build what their presets say; every control of a multirun is a run of its own name.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from multihead.model import build_model

from helpers.training import compose_config

# (experiment, the data's vocabulary as the runs have it, MHA's preset, its matched controls)
MATCHED = [
    ("lm_long", 4096, "mha_h8", ["gqa_h8_kv2", "mqa_h8", "mla_h8_r24"]),
    ("mqar", 8192, "mha_h8", ["gqa_h8_kv2", "mqa_h8"]),
    ("multi30k_en_de", 8000, "mha", ["gqa", "mqa"]),  # compare_designs: the same model
]


def build(experiment: str, vocab: int, attention: str, tmp_path):
    cfg = compose_config(
        "train",
        [f"experiment={experiment}", f"attention={attention}", f"paths.output_dir={tmp_path}"],
    )
    return build_model(OmegaConf.to_container(cfg, resolve=True), vocab_size=vocab, pad_id=0)


def parameters(model) -> int:
    """Every parameter once (a tied embedding is one tensor)."""
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "experiment, vocab, mha, design",
    [(e, v, m, d) for e, v, m, designs in MATCHED for d in designs],
    ids=lambda x: str(x),
)
def test_a_matched_control_has_mhas_parameters_within_one_percent(
    experiment, vocab, mha, design, tmp_path
):
    reference = parameters(build(experiment, vocab, mha, tmp_path))
    plain = build(experiment, vocab, design, tmp_path)
    matched = build(experiment, vocab, f"{design}_matched", tmp_path)
    # The design is the same (heads and cache), only the FFN is wider, by a multiple of 8.
    assert matched.head_config == plain.head_config
    assert matched.kv_cache_bytes_per_token() == plain.kv_cache_bytes_per_token()
    assert matched.ffn_dim > plain.ffn_dim and (matched.ffn_dim - plain.ffn_dim) % 8 == 0
    assert abs(parameters(plain) - reference) / reference > 0.01  # what the control is for
    assert abs(parameters(matched) - reference) / reference < 0.01
    assert f"ffn{matched.ffn_dim}" in matched.head_tag.split("_")
    assert "ffn" not in plain.head_tag


def test_the_lm_controls_widths_by_hand(tmp_path):
    """At d_model 128, 4 blocks, an FFN unit costs 4 x (2 x 128 + 1) = 1,028 parameters;
    GQA 8/2 has 4 x 24,768 fewer attention parameters than MHA (K and V of 2 heads of 16
    instead of 8: 2 x 6 x (128 x 16 + 16) per block), 96.4 units: 96 wide more, 608."""
    gqa = build("lm_long", 4096, "gqa_h8_kv2_matched", tmp_path)
    assert gqa.ffn_dim == 512 + 96


def test_the_positions_and_width_controls_build_what_they_say(tmp_path):
    rd6 = build("mqar", 8192, "mha_h8_rd6", tmp_path).head_config["decoder_self_attention"]
    assert (rd6["kind"], rd6["num_heads"], rd6["num_kv_heads"], rd6["rotary_dim"]) == (
        "mha", 8, 8, 6,
    )  # fmt: skip
    narrow = build("mqar", 8192, "mla_h8_r24_qk8", tmp_path)
    attn = next(narrow.attention_sublayers())[-1]
    # A score 8 + 8 = 16 features wide, MHA's head width; the cache MLA's 24 + 8 numbers.
    assert attn.design.qk_head_dim + attn.design.rope_dim == 128 // 8
    wide = build("mqar", 8192, "mla_h8_r24", tmp_path)
    assert narrow.kv_cache_bytes_per_token() == wide.kv_cache_bytes_per_token()


def test_every_control_of_the_long_context_multirun_has_a_run_name_of_its_own(tmp_path):
    presets = [
        "mha_h8", "gqa_h8_kv2", "mqa_h8", "mla_h8_r24", "gqa_h8_kv2_matched", "mqa_h8_matched",
        "mla_h8_r24_matched", "mha_h8_rd6", "mla_h8_r24_qk8",
    ]  # fmt: skip
    names = [build("mqar", 8192, p, tmp_path).head_tag for p in presets]
    assert len(set(names)) == len(names), names
