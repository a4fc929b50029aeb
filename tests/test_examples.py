"""The examples of docs/reuse.md run, and do what the page says they do."""

import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


def example(name: str) -> dict:
    return runpy.run_path(str(EXAMPLES / name))  # its functions, without running main


def test_causal_lm_trains_below_the_bound_and_samples_the_same_with_the_kv_cache(
    multi30k_dir,
) -> None:
    result = example("causal_lm.py")["main"](["--data", str(multi30k_dir)])
    assert result["val_loss"] < 2.0  # the bound docs/reuse.md states
    assert len(result["cached"]) == 100 and result["cached"] == result["full"]


def test_swapped_encoder_converts_to_mqa_and_recovers_by_uptraining() -> None:
    losses = example("uptrain_gqa.py")["main"]([])
    assert abs(losses["swapped"] - losses["mha"]) < 1e-5  # the swap changes nothing
    assert losses["mha"] < 0.01 and losses["converted"] > 1.0  # pooling K/V heads hurts
    # 50 steps recover most of it; the same model from scratch is still far off.
    assert losses["uptrained"] < losses["converted"] / 10
    assert losses["uptrained"] < losses["scratch"] / 5


def test_hf_models_match_eager_and_generate_the_same() -> None:
    pytest.importorskip("transformers", reason="transformers is the [hf] extra")
    results = example("hf_models.py")["main"]([])
    for result in results.values():  # what docs/reuse.md states
        assert result["max_diff"] < 1e-5 and result["same_tokens"]


def test_left_padded_loss_differs_from_eager_as_hfs_sdpa_does() -> None:
    pytest.importorskip("transformers", reason="transformers is the [hf] extra")
    results = example("hf_left_padded_loss.py")["main"]()
    padded = results["padding -100"]  # what docs/reuse.md states
    assert padded["sdpa"] > 1e-3
    assert padded["multihead"] == pytest.approx(padded["sdpa"], abs=1e-6)
    assert padded["swap"] == pytest.approx(padded["sdpa"], abs=1e-6)
    assert all(abs(d) < 1e-5 for d in results["padding and first token -100"].values())


def test_kv_cache_bytes_are_the_hand_counts() -> None:
    sizes = example("kv_cache_bytes.py")["main"]()
    # 4 layers x 4 bytes x the numbers cached per token: K and V of 8 or 1 heads of 16, or
    # MLA's latent r and rotary key d_R, stored once.
    assert sizes["MHA 8/8"] == 4 * 4 * 2 * 8 * 16 and sizes["MQA 8/1"] == 4 * 4 * 2 * 1 * 16
    assert sizes["MLA r = 32, rotary key d_R = 8"] == 4 * 4 * (32 + 8)
    assert sizes["MLA r = 16, rotary key d_R = 8"] == 4 * 4 * (16 + 8)


def test_a_head_design_written_outside_the_package_works_by_name() -> None:
    """docs/examples/own_head_design.py registers a design of its own; the layer and the
    Transformer build it by name and decode with the cache as in the full pass. The design
    does what it says: temperature t on every head equals the plain layer with its queries
    scaled by 1 / t (the same softmax(Q K^T / (sqrt(D) t)))."""
    import torch

    from multihead import MultiHeadAttention

    diffs = example("own_head_design.py")["main"]()
    assert diffs["layer"] < 1e-5 and diffs["model"] < 1e-5
    attn = MultiHeadAttention(32, 4, num_kv_heads=2, design="head_temperature", start=0.5)
    plain = MultiHeadAttention(32, 4, num_kv_heads=2)
    weights = {k: v for k, v in attn.state_dict().items() if not k.startswith("head_temp.")}
    plain.load_state_dict(weights)
    with torch.no_grad():
        for block in (plain.in_proj.blocks("weight")[0], plain.in_proj.blocks("bias")[0]):
            block.mul_(2.0)  # Q / 0.5
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(attn(x, is_causal=True), plain(x, is_causal=True))
    with torch.no_grad():
        attn.head_temp.log_temperature.zero_()  # t = 1: no longer the scaled layer
    assert (attn(x, is_causal=True) - plain(x, is_causal=True)).abs().max() > 1e-3
