"""experiment=compare_heads: the expected jobs, and a tiny real multirun on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from helpers import CONFIG_DIR
from helpers.scripts import run_script

EXPECTED = {  # (num_heads, num_kv_heads, kv_latent_dim) of every job
    (8, 8, None),
    (8, 4, None),
    (8, 2, None),
    (8, 1, None),  # MHA, GQA at two group sizes, MQA
    (8, 8, 32),
    (8, 8, 16),  # MLA with MQA's cache size (2 x head_dim 16), and half of it
    (4, 4, None),
    (2, 2, None),
    (1, 1, None),  # the head-count axis at the same width
}


def test_compare_heads_composes_into_the_expected_jobs(tmp_path) -> None:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        sweep = compose("train", ["experiment=compare_heads"], return_hydra_config=True)
        options = sweep.hydra.sweeper.params.attention.split(",")
        jobs = set()
        for option in options:
            cfg = compose("train", ["experiment=compare_heads", f"attention={option}"])
            heads = cfg.attention.num_heads
            latent = cfg.attention.design_options.get("kv_latent_dim")
            jobs.add((heads, cfg.attention.num_kv_heads or heads, latent))
            assert cfg.trainer.max_steps == 600 and cfg.seed == 1234  # budget=cpu, fixed seed
    assert jobs == EXPECTED


# Nine training jobs: CI's slow pass (`python -m pytest -m slow`), not the quick suite.
# budget=smoke at the recipe's width (d_model 128: 8 heads of 16), where the presets' latents
# are MQA's cache and half of it; smoke's own width (32: heads of 4) would make r=32 4x MQA's.
@pytest.mark.slow
def test_compare_heads_smoke_multirun(tmp_path: Path, multi30k_dir: Path) -> None:
    result = run_script(
        "train.py",
        "-m",
        "experiment=compare_heads",
        "budget=smoke",
        "model.d_model=128",
        "logger=csv",
        f"data.local_dir={multi30k_dir}",
        f"hydra.sweep.dir={tmp_path}",
        f"paths.cache_dir={tmp_path / 'cache'}",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "summary.limit=4",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in tmp_path.glob("*/summary.json")]
    assert {
        (s["num_heads"], s["num_kv_heads"], s.get("kv_latent_dim")) for s in summaries
    } == EXPECTED
    for s in summaries:
        assert s["kv_cache/bytes_per_token"] > 0 and s["decode/greedy_sentences_per_s"] > 0
    kv = {s["run_name"].split("_")[1]: s["kv_cache/bytes_per_token"] for s in summaries}
    assert kv["dec-mqa8"] * 8 == kv["dec-mha8"]  # MQA caches one K/V head instead of eight
    assert kv["dec-mla8r32"] == kv["dec-mqa8"] == 2 * kv["dec-mla8r16"]  # the latent alone


def test_compare_designs_composes_the_recipe_for_every_design() -> None:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        sweep = compose("train", ["experiment=compare_designs"], return_hydra_config=True)
        options = sweep.hydra.sweeper.params.attention.split(",")
        assert options == [
            "mha",
            "gqa",
            "mqa",
            "moh",
            "talking_heads",
            "group_mlp",
            "head_attention",
        ]
        designs = set()
        for option in options:
            cfg = compose("train", ["experiment=compare_designs", f"attention={option}"])
            assert cfg.trainer.max_time == "00:00:30:00" and cfg.test_ckpt == "avg10"
            assert cfg.module.optimizer.lr == 2e-3 and cfg.module.scheduler.cooldown_minutes == 10
            a = cfg.attention
            designs.add((a.num_kv_heads, a.design, a.design_options.get("top_k_heads"), a.backend))
    assert designs == {
        (None, None, None, "sdpa"),
        (2, None, None, "sdpa"),
        (1, None, None, "sdpa"),
        (None, "moh", 2, "sdpa"),
        (None, "talking_heads", None, "math"),
        (None, "group_mlp", None, "sdpa"),
        (None, "head_attention", None, "sdpa"),
    }
