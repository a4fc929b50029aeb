"""build_llama_lm: the config it asks for, and bad values refused in one line."""

from __future__ import annotations

import pytest

from multihead.integrations.llama import build_llama_lm

SIZES = dict(vocab_size=300, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64,
             max_positions=32)  # fmt: skip


def test_it_builds_the_llama_it_is_asked_for() -> None:
    model = build_llama_lm(**SIZES, num_kv_heads=2)
    config = model.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.hidden_size) == (
        4,
        2,
        32,
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert build_llama_lm(**SIZES).config.num_key_value_heads == 4  # None: MHA


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_heads": 3}, "num_heads=3 must divide hidden_size=32"),
        ({"num_kv_heads": 3}, "num_kv_heads=3 must divide num_heads=4"),
        ({"num_kv_heads": 0}, "num_kv_heads must be a positive int or None, got 0"),
        ({"num_layers": 0}, "num_layers must be a positive int, got 0"),
        ({"hidden_size": 12, "num_heads": 4}, "head width hidden_size/num_heads=3 must be even"),
    ],
)
def test_bad_values_are_refused_in_one_line(change, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as err:
        build_llama_lm(**{**SIZES, **change})
    assert "\n" not in str(err.value)
