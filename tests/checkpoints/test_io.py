"""Reading and writing checkpoints: self-contained, bad files refused and left alone, writes
that fail leave the old file, and a write is renamed within its own directory."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from multihead.checkpoints import (
    FORMAT_VERSION,
    load_trained_model,
    read_checkpoint,
    write_atomically,
)
from multihead.checkpoints.io import upgrade_config
from multihead.model import build_model
from multihead.training.run import train

from helpers.scripts import fails_in_one_line


def test_checkpoint_is_self_contained(smoke_run_dir: Path) -> None:
    loaded = load_trained_model(smoke_run_dir / "checkpoints" / "last.ckpt")
    assert not loaded.model.training
    assert loaded.config["data"]["tgt_lang"] == "de"
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("Ein Hund.")) == "Ein Hund."


@pytest.fixture
def ckpt(smoke_run_dir, tmp_path) -> Path:
    path = tmp_path / "good.ckpt"
    shutil.copy(smoke_run_dir / "checkpoints" / "last.ckpt", path)
    return path


def make_bad(kind: str, good: Path, path: Path) -> None:
    if kind == "truncated":
        path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif kind == "random bytes":
        path.write_bytes(os.urandom(4096))
    elif kind == "plain state_dict":
        torch.save(load_trained_model(good).model.state_dict(), path)
    elif kind == "another project's Lightning checkpoint":
        torch.save({"state_dict": {}, "epoch": 3, "pytorch-lightning_version": "2.6.0"}, path)
    elif kind == "another format version":
        ckpt = torch.load(good, weights_only=False)
        ckpt["multihead"]["format_version"] = FORMAT_VERSION + 1
        torch.save(ckpt, path)


@pytest.mark.parametrize(
    "kind, message",
    [
        ("truncated", "is not a readable checkpoint"),
        ("random bytes", "is not a readable checkpoint"),
        ("plain state_dict", "is not a multihead checkpoint"),
        ("another project's Lightning checkpoint", "is not a multihead checkpoint"),
        ("another format version", f"format version {FORMAT_VERSION + 1}; this multihead reads"),
    ],
)
def test_bad_checkpoints(ckpt, tmp_path, capsys, kind, message) -> None:
    bad = tmp_path / "bad.ckpt"
    make_bad(kind, ckpt, bad)
    before = bad.read_bytes()
    line = fails_in_one_line(load_trained_model, capsys, bad)
    assert message in line and str(bad) in line, line
    assert bad.read_bytes() == before  # left alone


def test_a_missing_checkpoint_is_named(capsys) -> None:
    line = fails_in_one_line(load_trained_model, capsys, "/nonexistent/x.ckpt")
    assert "checkpoint not found: /nonexistent/x.ckpt" in line, line


def test_a_full_disk_leaves_the_old_file_and_no_partial_one(tmp_path) -> None:
    target = tmp_path / "scores.json"
    target.write_text("old")

    def write_until_full(f) -> None:
        f.write(b"half of the new")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match=f"cannot write {target}: No space left"):
        write_atomically(target, write_until_full)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["scores.json"]


def test_checkpoints_never_stage_in_the_temp_directory(smoke_config, tmp_path, monkeypatch):
    """With TMPDIR on another filesystem, every checkpoint is still renamed within its own
    directory (a rename across filesystems would be a copy that a kill can tear)."""
    other = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path / "elsewhere"
    elsewhere = other / f"multihead-tmp-{os.getpid()}"
    elsewhere.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("TMPDIR", str(elsewhere))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    renames: list[tuple[Path, Path]] = []
    replace = os.replace

    def recording_replace(src, dst):
        renames.append((Path(src), Path(dst)))
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", recording_replace)
    cfg = smoke_config(
        "trainer.max_steps=4", "trainer.val_check_interval=2", "summary.decode_speed=false"
    )
    train(cfg)
    ckpts = [(src, dst) for src, dst in renames if dst.suffix == ".ckpt"]
    assert {dst.name for _, dst in ckpts} >= {"step2.ckpt", "step4.ckpt", "last.ckpt"}
    assert all(src.parent == dst.parent for src, dst in ckpts), ckpts
    assert list(elsewhere.iterdir()) == []
    elsewhere.rmdir()


# ----------------------------------------------------------------------- format 2 configs
# What scripts/train.py wrote under `attention` before a design's options moved under
# design_options (format 2): every design's options beside the layer's keys, each sublayer
# listing them all as null (= as the top level), the design chosen by them.
V2_TOP = {"top_k_heads": None, "num_shared_heads": 0, "design": None, "head_mixing": None,
          "mixing_groups": None, "kv_latent_dim": None, "kv_latent_norm": False}  # fmt: skip
V2_SUBLAYER = {"num_heads": None, "num_kv_heads": None, "backend": None} | dict.fromkeys(V2_TOP)
V3_SUBLAYER = {"num_heads": None, "num_kv_heads": None, "backend": None, "design": None}
PLAIN = {"num_heads": 4, "num_kv_heads": None, "backend": "sdpa"}
SUBLAYERS = ("encoder_self_attention", "decoder_self_attention", "cross_attention")

# Each sublayer its own design, chosen without a name; the top level's options off.
V2_MIXED = (
    PLAIN
    | V2_TOP
    | {
        "encoder_self_attention": V2_SUBLAYER | {"head_mixing": "group_mlp", "mixing_groups": 4},
        "decoder_self_attention": V2_SUBLAYER | {"kv_latent_dim": 16},
        "cross_attention": V2_SUBLAYER | {"top_k_heads": 2, "num_shared_heads": 1},
    }
)
V3_MIXED = (
    PLAIN
    | {"design": None, "design_options": {}}
    | {
        "encoder_self_attention": V3_SUBLAYER
        | {"design": "group_mlp", "design_options": {"mixing_groups": 4}},
        "decoder_self_attention": V3_SUBLAYER
        | {"design": "mla", "design_options": {"kv_latent_dim": 16, "kv_latent_norm": False}},
        "cross_attention": V3_SUBLAYER
        | {"design": "moh", "design_options": {"top_k_heads": 2, "num_shared_heads": 1}},
    }
)


@pytest.mark.parametrize(
    "v2, v3",
    [
        (V2_MIXED, V3_MIXED),
        (  # configs/attention/moh.yaml; the cross-attention's k alone, its shared head inherited
            PLAIN
            | V2_TOP
            | {"top_k_heads": 2, "num_shared_heads": 1}
            | {k: V2_SUBLAYER for k in SUBLAYERS}
            | {"cross_attention": V2_SUBLAYER | {"top_k_heads": 1}},
            PLAIN
            | {"design": "moh", "design_options": {"top_k_heads": 2, "num_shared_heads": 1}}
            | {k: V3_SUBLAYER | {"design_options": {}} for k in SUBLAYERS}
            | {"cross_attention": V3_SUBLAYER | {"design_options": {"top_k_heads": 1}}},
        ),
        (  # talking_heads.yaml; diff_h8.yaml (named, its lambda_init null: left out)
            PLAIN | V2_TOP | {"head_mixing": "talking_heads", "backend": "math"},
            PLAIN | {"design": "talking_heads", "design_options": {}, "backend": "math"},
        ),
        (
            PLAIN | V2_TOP | {"design": "diff", "lambda_init": None},
            PLAIN | {"design": "diff", "design_options": {}},
        ),
    ],
    ids=["per_sublayer", "moh", "talking_heads", "diff"],
)
def test_a_format_2_attention_config_is_read_in_format_3s_form(v2, v3) -> None:
    assert upgrade_config({"attention": v2, "model": {"d_model": 32}}) == {
        "attention": v3, "model": {"d_model": 32}
    }  # fmt: skip


def test_a_format_2_checkpoint_loads_with_the_designs_it_was_trained_with(ckpt, tmp_path):
    """Written here by hand: the smoke run's checkpoint with V2_MIXED, and the weights of
    those designs."""
    old = torch.load(ckpt, weights_only=False)
    config = old["multihead"]["config"]
    tokenizer = load_trained_model(ckpt).tokenizer
    built = build_model({**config, "attention": V3_MIXED}, tokenizer.vocab_size, tokenizer.pad_id)
    old["state_dict"] = {f"model.{k}": v for k, v in built.state_dict().items()}
    old["multihead"] |= {"format_version": 2, "config": {**config, "attention": V2_MIXED}}
    torch.save(old, tmp_path / "v2.ckpt")
    loaded = load_trained_model(tmp_path / "v2.ckpt")
    assert loaded.model.head_tag == "enc-mha4-group_mlp4_dec-mla4r16_cross-mha4-moh-k2s1_sdpa"
    assert loaded.config["attention"] == V3_MIXED
    assert read_checkpoint(tmp_path / "v2.ckpt")["multihead"]["format_version"] == FORMAT_VERSION
