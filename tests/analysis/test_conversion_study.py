"""Issue 56's conversion study: a rotary checkpoint to MLA with partial RoPE through the
checkpoint path, and the study end to end on a tiny rotary run."""

from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from multihead.analysis.conversion_study import (
    MLA_METHODS,
    check_study,
    conversion_target,
    mla_options,
    paired_block_tests,
    paired_sentence_tests,
    run_study,
    uptrain_steps,
)
from multihead.checkpoints import load_trained_model
from multihead.checkpoints.conversion import convert_kv_heads, training_batches
from multihead.model import build_model

from helpers.scripts import assert_one_error_line, fails_in_one_line, run_script, script_main
from helpers.training import compose_config, smoke_overrides


@pytest.fixture(scope="module")
def rope_run(tmp_path_factory, multi30k_dir, cache_dir) -> Path:
    """The smoke experiment with rotary positions, 4 steps, with Hydra's overrides record."""
    from multihead.training.run import train

    out = tmp_path_factory.mktemp("rope_run")
    overrides = [*smoke_overrides(out, multi30k_dir, cache_dir), "model.positional=rope"]
    run = [*overrides, "trainer.max_steps=4", "test=false", "summary.decode_speed=false"]
    train(compose_config("train", run))
    (out / ".hydra").mkdir()
    (out / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(overrides))
    return out / "checkpoints" / "last.ckpt"


def test_rotary_mla_checkpoint_is_exact_at_full_rank_and_rebuilds(rope_run, tmp_path) -> None:
    """d_model 32, 4 heads of 8 all rotated: every rotary feature kept (rope_dim=None) and a
    latent of the K/V rank (32) give the original model; the printed overrides rebuild it."""
    out = tmp_path / "mla.ckpt"
    full = {"decoder_self_attention": 32, "cross_attention": 32}
    written, overrides = convert_kv_heads(rope_run, None, out, kv_latent_dim=full)
    old, new = load_trained_model(rope_run).model, load_trained_model(written).model
    tag = new.head_config["decoder_self_attention"]["tag"]  # every feature rotates: qk0
    assert re.fullmatch(r"mla4r32rope8x4qk0-[0-9a-f]{6}", tag), tag
    src, tgt = torch.randint(4, 100, (3, 9)), torch.randint(4, 100, (3, 6))
    with torch.no_grad():
        torch.testing.assert_close(new(src, tgt), old(src, tgt), atol=1e-4, rtol=1e-4)

    partial = {"decoder_self_attention": 8, "cross_attention": 16}
    written, overrides = convert_kv_heads(
        rope_run, None, tmp_path / "partial.ckpt", kv_latent_dim=partial, rope_dim=2
    )
    converted = load_trained_model(written)
    # 2 decoder layers, fp32: (r + G * rope_dim) numbers per token = 8 + 4 * 2
    assert converted.model.kv_cache_bytes_per_token() == 2 * (8 + 4 * 2) * 4
    composed = compose_config(
        "train", [*overrides, f"paths.output_dir={tmp_path}", f"paths.cache_dir={tmp_path}"]
    )
    tok = converted.tokenizer
    rebuilt = build_model(
        OmegaConf.to_container(composed, resolve=True), tok.vocab_size, tok.pad_id
    ).eval()
    assert rebuilt.head_config == converted.model.head_config
    rebuilt.load_state_dict(converted.model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(src, tgt), converted.model(src, tgt))


def test_a_checkpoint_calibrated_on_its_own_training_batches_with_a_shared_key(
    rope_run, tmp_path, multi30k_dir
) -> None:
    """Issue 67: the PCA of the outputs on the run's first 2 training batches and one shared
    rotary key of 32 numbers (4 groups x 8 rotary features: nothing dropped) are exact at
    full rank, K/V balancing measured (issue 74: the record names what each layer kept); the
    record and the printed overrides rebuild it; refusals in one line."""
    ckpt = torch.load(rope_run, map_location="cpu", weights_only=False)
    batches = training_batches(ckpt, 2, str(multi30k_dir))
    assert len(batches) == 2 and all(src.dim() == tgt.dim() == 2 for src, tgt in batches)
    full = {"decoder_self_attention": 32, "cross_attention": 32}  # 2GD - 32 = 32; E = 32
    written, overrides = convert_kv_heads(
        rope_run, None, tmp_path / "shared.ckpt", kv_latent_dim=full, rope_dim=32,
        rotary_key="shared", factorisation="pca", calibration_batches=2,
        local_dir=str(multi30k_dir),
    )  # fmt: skip
    old, new = load_trained_model(rope_run).model, load_trained_model(written).model
    tag = new.head_config["decoder_self_attention"]["tag"]  # one shared 32-wide rotary key
    assert re.fullmatch(r"mla4r32rope32-[0-9a-f]{6}", tag), tag
    src, tgt = torch.randint(4, 100, (3, 9)), torch.randint(4, 100, (3, 6))
    with torch.no_grad():
        torch.testing.assert_close(new(src, tgt), old(src, tgt), atol=1e-4, rtol=1e-4)
    info = torch.load(written, map_location="cpu", weights_only=False)["multihead"]
    assert {k: info["converted_from"][k] for k in ("rotary_key", "factorisation",
            "calibration_batches", "balance_kv")} == {"rotary_key": "shared",
            "factorisation": "pca", "calibration_batches": 2, "balance_kv": None}  # fmt: skip
    # Exact either way, so the tie goes to no balancing; every converted layer is named.
    chosen = info["converted_from"]["chosen"]
    assert set(chosen) == {f"decoder_layers.{i}.{a}" for a in ("cross_attn", "self_attn")
                           for i in (0, 1)}  # fmt: skip
    assert chosen["decoder_layers.0.self_attn"] == {
        "kv_latent": 32,
        "factorisation": "pca",
        "balance_kv": False,
        "rotary_key": "shared",
        "rope_dim": 32,
    }
    composed = compose_config(
        "train", [*overrides, f"paths.output_dir={tmp_path}", f"paths.cache_dir={tmp_path}"]
    )
    tok = load_trained_model(written).tokenizer
    rebuilt = build_model(
        OmegaConf.to_container(composed, resolve=True), tok.vocab_size, tok.pad_id
    )
    assert rebuilt.head_config == new.head_config
    with pytest.raises(ValueError, match=r"calibration_batches=2 would be ignored: num_kv_heads=2"):
        convert_kv_heads(rope_run, 2, tmp_path / "x.ckpt", calibration_batches=2)
    with pytest.raises(ValueError, match=r"calibration_batches must be >= 1, got -1"):
        convert_kv_heads(rope_run, None, tmp_path / "x.ckpt", kv_latent_dim=8,
                         calibration_batches=-1)  # fmt: skip


def test_the_fixed_methods_name_every_choice_and_the_default_none() -> None:
    """Issue 74: a fixed row is exactly its choices (nothing measured); mla_default leaves
    them all to the measurement, on the calibration batches, with per-group keys' rope_dim."""
    for method, options in MLA_METHODS.items():
        if method not in ("mla_default", "mla_budget"):
            assert set(options) == {"factorisation", "balance_kv", "rotary_key"}
    assert mla_options("unused.ckpt", "mla_default", 4, "high", 8, "data") == {
        "calibration_batches": 8,
        "local_dir": "data",
        "rope_dim": 4,
        "selection": "high",
    }
    # The budget measures the rotary keys' width too: no rope_dim (issue 84); a fixed split
    # of it names its own, whatever the study's rope_dim.
    assert mla_options("unused.ckpt", "mla_budget", 4, "high", 8, "data") == {
        "calibration_batches": 8,
        "local_dir": "data",
    }
    assert mla_options("unused.ckpt", "mla_budget@rope8", 4, "high", 8, "data") == {
        "calibration_batches": 8,
        "local_dir": "data",
        "rope_dim": 8,
    }


def test_a_checkpoint_converts_within_a_cache_budget_and_its_overrides_rebuild_it(
    rope_run, tmp_path, multi30k_dir, capsys
) -> None:
    """Issue 84, through the CLI's function: each decoder sublayer (4 K/V heads of D = 8, 64
    numbers, 256 bytes a token) at 1/2, 32 numbers: the rotary self-attention's per-group keys
    of 2 or 4 features (4 groups: 8 or 16 numbers) or one shared key of 8 or 16, the latent
    the rest (24 or 16); cross-attention's all latent (32). Measured on the run's own first 2
    training batches; the record names each layer's split; the overrides rebuild it. The
    study's targets: 1/4 reachable (16 numbers: keys of 8 leave 8), 1/8 not (8 numbers)."""
    written, overrides = convert_kv_heads(
        rope_run, None, tmp_path / "budget.ckpt", cache_budget=0.5, calibration_batches=2,
        local_dir=str(multi30k_dir),
    )  # fmt: skip
    new = load_trained_model(written).model
    for layer in new.decoder_layers:
        assert layer.self_attn.kv_cache_bytes_per_token() == 128
        assert layer.cross_attn.kv_cache_bytes_per_token() == 128
    info = torch.load(written, map_location="cpu", weights_only=False)["multihead"]
    assert info["converted_from"]["cache_budget"] == 0.5
    chosen = info["converted_from"]["chosen"]
    first = chosen["decoder_layers.0.self_attn"]
    keys = first["rope_dim"] * (4 if first["rotary_key"] == "per_group" else 1)
    assert (first["kv_latent"], keys) in ((24, 8), (16, 16))
    assert chosen["decoder_layers.0.cross_attn"]["kv_latent"] == 32
    composed = compose_config(
        "train", [*overrides, f"paths.output_dir={tmp_path}", f"paths.cache_dir={tmp_path}"]
    )
    tok = load_trained_model(written).tokenizer
    rebuilt = build_model(
        OmegaConf.to_container(composed, resolve=True), tok.vocab_size, tok.pad_id
    ).eval()
    assert rebuilt.head_config == new.head_config
    rebuilt.load_state_dict(new.state_dict())
    assert conversion_target(rope_run, "mla_budget", 2, 4) == {"cache_budget": 0.5}
    assert conversion_target(rope_run, "mla_budget", 4, 4) == {"cache_budget": 0.25}
    assert conversion_target(rope_run, "mla_budget", 8, 4) is None
    # A fixed split: keys of 2 per group (8 numbers) fit 1/4's 16, keys of 4 (16) do not.
    assert conversion_target(rope_run, "mla_budget@rope2", 4, 4) == {"cache_budget": 0.25}
    assert conversion_target(rope_run, "mla_budget@rope4", 4, 4) is None
    assert conversion_target(rope_run, "mla_budget@rope4", 2, 4) == {"cache_budget": 0.5}
    # The CLI: a budget it cannot spend, in one line, nothing written.
    line = fails_in_one_line(
        script_main, capsys, "convert_kv_heads.py", "convert", f"ckpt={rope_run}",
        "cache_budget=0.125", "calibration_batches=2", f"local_dir={multi30k_dir}",
        f"out={tmp_path / 'x.ckpt'}",
    )  # fmt: skip
    assert line == (
        "error: cache_budget=0.125 allows decoder_layers.0.self_attn 32 bytes per token, too "
        "few for any split: its narrowest rotary keys take 32 bytes, and a latent needs at "
        "least 4 more"
    )
    assert not (tmp_path / "x.ckpt").exists()


def test_per_kind_latent_is_refused_unless_it_names_every_kind(rope_run, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"kv_latent_dim=\{'cross_attention': 8\} must give one r"):
        convert_kv_heads(rope_run, None, tmp_path / "x.ckpt", kv_latent_dim={"cross_attention": 8})
    assert not (tmp_path / "x.ckpt").exists()


def test_uptrain_steps_are_multiples_of_the_smallest_fractions() -> None:
    # 1% of 2238 = 22.38 -> 22; 2% and 5%: 2 and 5 times that.
    assert uptrain_steps(2238, [0.05, 0.01, 0.02]) == {0.01: 22, 0.02: 44, 0.05: 110}


@pytest.mark.slow  # a study: 2 designs at 2 ratios, uptrained
def test_study_writes_every_row_and_marks_unreachable_ratios(
    rope_run, tmp_path, multi30k_dir
) -> None:
    """Issue 56's MLA beside issue 67's last ablation row (PCA on 2 calibration batches, K/V
    balancing, one shared rotary key), every row distilled from the trained checkpoint."""
    out = tmp_path / "study"
    rows = run_study(
        rope_run, out, methods=["mla_svd", "mla_pca_bkv_shared"], ratios=[4, 8], rope_dim=2,
        fractions=[0.25, 0.5], calibration_batches=2, distill=True, beam_size=1,
        local_dir=str(multi30k_dir), limit=4,
    )  # fmt: skip
    # MHA: 2 * 4 heads * 8 * 4 bytes * 2 layers. MLA 1/8: 8 numbers, all taken by 4 x 2 rotary.
    assert [(r["method"], r["ratio"], r["uptrain_steps"]) for r in rows] == [
        ("mha", 1, 0), ("mha", 1, 1), ("mha", 1, 2),
        ("mla_svd", 8, None), ("mla_pca_bkv_shared", 8, None),
        ("mla_svd", 4, 0), ("mla_svd", 4, 1), ("mla_svd", 4, 2),
        ("mla_pca_bkv_shared", 4, 0), ("mla_pca_bkv_shared", 4, 1), ("mla_pca_bkv_shared", 4, 2),
    ]  # fmt: skip
    assert all(r["distill"] is True for r in rows)
    assert rows[3]["target"] == "n/a" and rows[3]["bleu_lc_tok"] is None
    assert {r["kv_bytes_per_token"] for r in rows[:3]} == {512}
    assert {r["kv_bytes_per_token"] for r in rows[5:]} == {128}  # per-group or shared keys alike
    assert {r["cross_kv_bytes_per_source_token"] for r in rows[5:]} == {128}
    for row in rows[1:3] + rows[6:8] + rows[9:]:
        assert Path(row["checkpoint"]).is_file()
        assert row["checkpoint"].endswith(f"uptrain/checkpoints/step{row['uptrain_steps']}.ckpt")
    tags = [load_trained_model(rows[i]["checkpoint"]).model.head_config["decoder_self_attention"]
            ["tag"] for i in (7, 10)]  # fmt: skip
    # per-group keys 2 wide (6 position-free of each head's 8), then one shared 8-wide key; a
    # converted layer's scale and frequencies are not the defaults: a digest ends each tag
    assert re.fullmatch(r"mla4r8rope2x4qk6-[0-9a-f]{6}", tags[0]), tags
    assert re.fullmatch(r"mla4r8rope8-[0-9a-f]{6}", tags[1]), tags
    for method in ("mha1", "mla_svd4", "mla_pca_bkv_shared4"):
        command = json.loads((out / method / "uptrain_command.json").read_text())
        assert f"distill_from={rope_run}" in command
    converted = torch.load(out / "mla_pca_bkv_shared4" / "converted.ckpt", weights_only=False)
    assert converted["multihead"]["converted_from"]["calibration_batches"] == 2
    for row in rows:
        if row["bleu_lc_tok"] is not None:
            where = out / f"{row['method']}{row['ratio']}" / f"score_step{row['uptrain_steps']}"
            assert json.loads((where / "scores.json").read_text())["sentences"] == 4
    assert [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()] == rows
    with open(out / "rows.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert (out / "bleu_vs_uptraining.png").stat().st_size > 0
    with pytest.raises(FileExistsError, match=r"other settings \(methods=\['mla_svd', "):
        run_study(rope_run, out)

    # Stopped while measuring mla_svd 1/4 (its converted score written, nothing after):
    # run again with the same settings, the complete rows stay as they are and that row and
    # the next are measured from their conversion, to the same scores.
    lines = (out / "rows.jsonl").read_text().splitlines()
    (out / "rows.jsonl").write_text("".join(line + "\n" for line in lines[:6]))
    shutil.rmtree(out / "mla_pca_bkv_shared4")
    (out / "mla_svd4" / "uptrain" / "checkpoints" / "step2.ckpt").unlink()
    control = out / "mha1" / "uptrain" / "checkpoints" / "step2.ckpt"
    control_written = control.stat().st_mtime_ns
    again = run_study(
        rope_run, out, methods=["mla_svd", "mla_pca_bkv_shared"], ratios=[4, 8], rope_dim=2,
        fractions=[0.25, 0.5], calibration_batches=2, distill=True, beam_size=1,
        local_dir=str(multi30k_dir), limit=4,
    )  # fmt: skip

    # The same scores; a conversion measured again spends its own CPU seconds (each row's
    # convert_cpu_seconds: the conversion's cost, none for the control).
    def scores(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "convert_cpu_seconds"} for r in rows]

    assert scores(again) == scores(rows)
    assert [r["convert_cpu_seconds"] is None for r in again] == [
        r["method"] == "mha" or r["target"] == "n/a" for r in again
    ]
    assert all(r["convert_cpu_seconds"] > 0 for r in again if r["convert_cpu_seconds"] is not None)
    # The complete rows kept as they were; row 5, the stopped row's converted score, is
    # measured again with its conversion (its CPU seconds are the new measurement's).
    assert again[:5] == rows[:5]
    assert control.stat().st_mtime_ns == control_written
    assert [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()] == again


@pytest.mark.parametrize(
    ("methods", "ratios", "fractions", "message"),
    [
        (["mla"], [2], [0.01], r"methods=\['mla'\]; expected a list of gqa, mla_svd, mla_pca, "),
        (["gqa"], [1], [0.01], "ratios: 1 is not an integer >= 2"),
        (["mla_budget@rope3"], [2], [0.01], r"'mla_budget@rope3': expected mla_budget@rope<d>, "),
        (["mla_default@rope4"], [2], [0.01], r"or mla_budget@rope<d> \(a fixed split"),
        (["gqa"], [2], [0.0], r"fractions=\[0.0\]; expected numbers in \(0, 1\]"),
    ],
)
def test_bad_settings_are_refused(methods, ratios, fractions, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_study(methods, ratios, fractions)


def test_script_refuses_a_bad_ratio_or_switch_in_one_line(tmp_path, capsys) -> None:
    line = fails_in_one_line(
        script_main, capsys, "conversion_study.py", "conversion_study",
        f"ckpt={tmp_path / 'a.ckpt'}", f"out={tmp_path / 'study'}", "ratios=[3,1]",
    )  # fmt: skip
    assert line == "error: ratios: 1 is not an integer >= 2 (cache 1/k of MHA's)"
    assert not (tmp_path / "study").exists()
    line = fails_in_one_line(
        script_main, capsys, "conversion_study.py", "conversion_study",
        f"ckpt={tmp_path / 'a.ckpt'}", f"out={tmp_path / 'study'}", "distill=no",
    )  # fmt: skip
    assert line == "error: distill must be a bool, got 'no'"
    assert not (tmp_path / "study").exists()


def _lm_study(default: dict[str, list[float]], svd: dict[str, list[float]]) -> dict:
    """A convert_lm.py results.json: the control, the default and the SVD at 1/8."""
    mha = {"name": "MHA", "block_loss": {"0": [1.0, 1.0, 1.0], "100": [1.0, 1.0, 1.0]}}
    return {"rows": [mha, {"name": "mla_default 1/8", "block_loss": default},
                     {"name": "mla_svd 1/8", "block_loss": svd}]}  # fmt: skip


def test_the_lm_studys_tests_pair_held_out_blocks_averaged_over_seeds() -> None:
    """Block differences (SVD minus default) of 0.1, 0.2, 0.3 on average over two seeds: t =
    0.2 / (0.1 / sqrt 3) = 2 sqrt 3 on 2 degrees of freedom, whose two-sided p is
    1 - t / sqrt(2 + t^2) = 1 - sqrt(12 / 14) (Student's t with 2 df in closed form)."""
    base = {"0": [2.0, 2.0, 2.0], "100": [1.5, 1.5, 1.5]}
    seed0 = _lm_study(base, {"0": [2.1, 2.2, 2.3], "100": [1.5, 1.7, 1.9]})
    seed1 = _lm_study(base, {"0": [2.1, 2.2, 2.3], "100": [1.7, 1.7, 1.7]})  # same mean
    tests = paired_block_tests([seed0, seed1])
    assert [(t["ratio"], t["method"], t["step"], t["blocks"]) for t in tests] == [
        ("1/8", "mla_svd", 0, 3),
        ("1/8", "mla_svd", 100, 3),
    ]  # the MHA control is not tested
    p = 1 - (12 / 14) ** 0.5
    for t in tests:
        assert t["p"] == pytest.approx(p, rel=1e-6)
        assert t["p_holm"] == pytest.approx(2 * p, rel=1e-6)  # two tests, equal p
        assert t["delta_pct"] == pytest.approx(100 * (2.718281828459045**0.2 - 1), rel=1e-9)
        assert t["seed_deltas"] == pytest.approx([t["delta_pct"]] * 2, rel=1e-9)


def test_a_row_that_is_the_baselines_model_is_not_tested() -> None:
    """Issue 84's budget study: where the measured split is a fixed row's, the two are one
    model. A t-test of zeros, or sacreBLEU's bootstrap of a system against itself (p 0.001),
    is no test: the row is marked the same and Holm runs over the others alone."""
    base = {"0": [2.0, 2.0, 2.0], "100": [1.5, 1.5, 1.5]}
    seed0 = _lm_study(base, {"0": [2.1, 2.2, 2.3], "100": [1.5, 1.7, 1.9]})
    seed0["rows"].append({"name": "mla_pca 1/8", "block_loss": base})
    seed1 = _lm_study(base, {"0": [2.1, 2.2, 2.3], "100": [1.7, 1.7, 1.7]})
    seed1["rows"].append({"name": "mla_pca 1/8", "block_loss": base})
    tests = paired_block_tests([seed0, seed1])
    same = [t for t in tests if t["same"]]
    assert [(t["method"], t["step"]) for t in same] == [("mla_pca", 0), ("mla_pca", 100)]
    assert all("p" not in t and "p_holm" not in t for t in same)
    p = 1 - (12 / 14) ** 0.5  # as above: Holm over the two real tests only
    assert [t["p_holm"] for t in tests if not t["same"]] == pytest.approx([2 * p, 2 * p])


def test_an_lm_study_without_block_losses_is_refused_by_name() -> None:
    old = {"rows": [{"name": "MHA", "ppl": {"0": 26.3}}]}
    with pytest.raises(ValueError, match=r"study 0: rows \['MHA'\] hold no block_loss"):
        paired_block_tests([old])


@pytest.fixture(scope="module")
def test2016(multi30k_dir) -> list[str]:
    from multihead.data import load_parallel_dataset

    splits = load_parallel_dataset("multi30k", "en", "de", local_dir=multi30k_dir)
    return list(splits["test"]["tgt"])


def _wrong_every(refs: list[str], every: int, offset: int) -> list[str]:
    """Hypotheses with every ``every``-th sentence another row's reference: a known BLEU."""
    return [refs[(i + 7) % len(refs)] if i % every == offset else r for i, r in enumerate(refs)]


def _translation_study(out: Path, refs: list[str], hyps: dict[tuple[str, int], list[str]]) -> Path:
    """A conversion_study.py directory: rows.jsonl and each row's hypotheses, as run_study
    writes them (MHA, the default and the SVD at 1/8, steps 0, 5 and 10; 1/4 n/a)."""
    rows = []
    for (method, steps), lines in hyps.items():
        ratio = 1 if method == "mha" else 8
        where = out / f"{method}{ratio}" / f"score_step{steps}"
        where.mkdir(parents=True)
        (where / "hypotheses.test.txt").write_text("".join(f"{line}\n" for line in lines))
        rows.append({"method": method, "ratio": ratio, "uptrain_steps": steps, "bleu_lc_tok": 1.0})
    rows.append({"method": "mla_svd", "ratio": 4, "uptrain_steps": None, "bleu_lc_tok": None})
    (out / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out


def _seeds(refs: list[str]) -> list[dict[tuple[str, int], list[str]]]:
    """Two seeds' hypotheses: the converted rows (step 0) are the same in both, as the
    uptraining seed cannot reach them; the SVD is worse after uptraining in both."""
    converted = {("mha", 0): refs, ("mla_default", 0): _wrong_every(refs, 3, 0),
                 ("mla_svd", 0): _wrong_every(refs, 2, 1)}  # fmt: skip
    return [
        {**converted, ("mla_default", 5): refs, ("mla_svd", 5): refs,
         ("mla_default", 10): _wrong_every(refs, 5, 0), ("mla_svd", 10): _wrong_every(refs, 4, 1)},
        {**converted, ("mla_default", 5): refs, ("mla_svd", 5): refs,
         ("mla_default", 10): _wrong_every(refs, 6, 2), ("mla_svd", 10): _wrong_every(refs, 3, 2)},
    ]  # fmt: skip


def test_the_translation_studys_tests_pair_sentences_averaged_over_seeds(test2016, tmp_path):
    """Against sacreBLEU: each Δ is the seeds' mean corpus-BLEU difference; right after
    conversion the seeds' hypotheses are the same, so the test is sacreBLEU's own paired
    bootstrap of one seed; only steps 0 and the last are tested, the control never."""
    import sacrebleu

    from multihead.analysis.significance import paired_tests

    refs = test2016[:200]
    seeds = _seeds(refs)
    studies = [_translation_study(tmp_path / f"seed{i}", refs, h) for i, h in enumerate(seeds)]
    tests = paired_sentence_tests(studies, refs, "de", metric="sacrebleu")
    assert [(t["ratio"], t["method"], t["step"], t["sentences"]) for t in tests] == [
        (8, "mla_svd", 0, 200), (8, "mla_svd", 10, 200),
    ]  # fmt: skip

    def bleu(lines: list[str]) -> float:
        return sacrebleu.corpus_bleu(lines, [refs]).score

    for test in tests:
        step = test["step"]
        deltas = [bleu(h[("mla_svd", step)]) - bleu(h[("mla_default", step)]) for h in seeds]
        assert test["seed_deltas"] == pytest.approx(deltas, abs=1e-9)
        assert test["delta"] == pytest.approx(sum(deltas) / 2, abs=1e-9) and test["delta"] < 0
        assert test["low"] <= test["delta"] <= test["high"]
    one_seed = paired_tests(seeds[0][("mla_default", 0)], {"svd": seeds[0][("mla_svd", 0)]},
                            refs, metric="sacrebleu")["svd"]  # fmt: skip
    assert tests[0]["p"] == one_seed.p_value
    smaller = min(t["p"] for t in tests)
    assert min(t["p_holm"] for t in tests) == pytest.approx(min(1.0, 2 * smaller))
    # A row with the default's translations in every seed is the same model: not tested.
    for h in seeds:
        h.update({("mla_pca", step): h[("mla_default", step)] for step in (0, 5, 10)})
    studies = [_translation_study(tmp_path / f"same{i}", refs, h) for i, h in enumerate(seeds)]
    again = paired_sentence_tests(studies, refs, "de", metric="sacrebleu")
    assert [(t["method"], t["step"]) for t in again if t["same"]] == [
        ("mla_pca", 0),
        ("mla_pca", 10),
    ]
    assert [t["p_holm"] for t in again if not t["same"]] == [t["p_holm"] for t in tests]


@pytest.mark.slow  # conversion_tests.py 4 times, 1,000 sentences
def test_the_tests_script_reads_a_translation_study_and_refuses_bad_directories(
    test2016, tmp_path, multi30k_dir
) -> None:
    """conversion_tests.py on the test set's 1,000 references: one table row per test; a
    directory of neither study, LM beside translation, or no --data: one line each."""
    studies = [str(_translation_study(tmp_path / f"seed{i}", test2016, h))
               for i, h in enumerate(_seeds(test2016))]  # fmt: skip
    result = run_script("conversion_tests.py", *studies, "--data", str(multi30k_dir))
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    table = [line.split(" | ")[:4] for line in lines if line.startswith("| 1/")]
    assert [row[:3] for row in table] == [["| 1/8", "mla_svd", "0"], ["| 1/8", "mla_svd", "10"]]
    assert all(float(row[3]) < 0 for row in table)  # the SVD is worse: negative Δ BLEU
    assert_one_error_line(run_script("conversion_tests.py", *studies), "needs --data")
    lm = tmp_path / "lm"
    lm.mkdir()
    (lm / "results.json").write_text("{}")
    assert_one_error_line(run_script("conversion_tests.py", studies[0], str(lm)), "mix LM and")
    result = run_script("conversion_tests.py", str(tmp_path), "--data", str(multi30k_dir))
    assert_one_error_line(result, f"{tmp_path} holds neither results.json nor rows.jsonl")
