"""MHA to GQA/MQA checkpoint conversion: exact pooling, round trip, clear refusals."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from multihead.attention import MultiHeadAttention
from multihead.checkpoints import load_trained_model, read_checkpoint
from multihead.checkpoints.conversion import (
    convert_attention,
    convert_checkpoint,
    convert_kv_heads,
    resolve_scope,
)
from multihead.checkpoints.io import save_new
from multihead.evaluation import evaluate_checkpoint
from multihead.model import Transformer, build_model

from helpers.scripts import run_script, script_main
from helpers.training import compose_config


def tiny_model(backend: str = "sdpa") -> Transformer:
    torch.manual_seed(0)
    return Transformer(
        src_vocab_size=50,
        tgt_vocab_size=50,
        d_model=16,
        ffn_dim=32,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dropout=0.1,
        max_positions=1024,
        attention={"num_heads": 4, "backend": backend},
    ).eval()


def sublayers(model: Transformer) -> dict[str, list[MultiHeadAttention]]:
    return {
        "encoder_self_attention": [layer.self_attn for layer in model.encoder_layers],
        "decoder_self_attention": [layer.self_attn for layer in model.decoder_layers],
        "cross_attention": [layer.cross_attn for layer in model.decoder_layers],
    }


def make_groups_identical(attn: MultiHeadAttention, groups: int) -> None:
    """Copy the first K/V head of each group over the others: pooling is then lossless."""
    G, D, E = attn.num_kv_heads, attn.head_dim, attn.embed_dim
    with torch.no_grad():
        for param in (attn.in_proj.weight, attn.in_proj.bias):
            for start in (E, E + G * D):  # the K rows, then the V rows
                heads = param[start : start + G * D].view(groups, G // groups, D, -1)
                heads.copy_(heads[:, :1].expand_as(heads))


@pytest.mark.parametrize("scope", ["decoder", "all"])
@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_identical_heads_in_each_group_convert_exactly(scope, backend) -> None:
    model = tiny_model(backend)
    for kind in resolve_scope(scope):
        for attn in sublayers(model)[kind]:
            make_groups_identical(attn, groups=2)
    src, tgt_in = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 5))
    src[0, 5:] = 0  # some padding
    with torch.no_grad():
        before = model(src, tgt_in)
        convert_attention(model, kv_heads=2, scope=scope)
        after = model(src, tgt_in)
    torch.testing.assert_close(after, before)
    converted = {"decoder_self_attention", "cross_attention"}
    if scope == "all":
        converted.add("encoder_self_attention")
    for kind, cfg in model.head_config.items():
        assert cfg["num_kv_heads"] == (2 if kind in converted else 4)
        assert cfg["backend"] == backend


def test_pooling_is_the_mean_of_each_groups_rows() -> None:
    model = tiny_model()
    old = model.decoder_layers[1].cross_attn
    w, b = old.in_proj.weight.detach().clone(), old.in_proj.bias.detach().clone()
    convert_attention(model, kv_heads=1, scope=["cross_attention"])  # MQA: the mean of all 4
    new = model.decoder_layers[1].cross_attn
    E, D = 16, 4
    k_rows = [w[E + h * D : E + (h + 1) * D] for h in range(4)]
    v_rows = [w[E + 16 + h * D : E + 16 + (h + 1) * D] for h in range(4)]
    expected_w = torch.cat([w[:E], sum(k_rows) / 4, sum(v_rows) / 4])
    k_bias = [b[E + h * D : E + (h + 1) * D] for h in range(4)]
    v_bias = [b[E + 16 + h * D : E + 16 + (h + 1) * D] for h in range(4)]
    expected_b = torch.cat([b[:E], sum(k_bias) / 4, sum(v_bias) / 4])
    assert new.in_proj.weight.shape == (E + 2 * D, E)
    torch.testing.assert_close(new.in_proj.weight, expected_w)
    torch.testing.assert_close(new.in_proj.bias, expected_b)
    torch.testing.assert_close(new.out_proj.weight, old.out_proj.weight)
    assert model.decoder_layers[0].self_attn.num_kv_heads == 4  # not in scope


def test_scope_names() -> None:
    assert resolve_scope("decoder") == ("decoder_self_attention", "cross_attention")
    assert len(resolve_scope("all")) == 3
    assert resolve_scope(["cross_attention", "encoder_self_attention"]) == (
        "encoder_self_attention",
        "cross_attention",
    )
    with pytest.raises(ValueError, match="unknown scope 'encoder'; expected decoder, all"):
        resolve_scope("encoder")
    with pytest.raises(ValueError, match="unknown scope"):
        resolve_scope(["cross"])
    with pytest.raises(ValueError, match="unknown scope"):
        resolve_scope([])


def test_a_parameter_matched_checkpoint_converts_with_the_ffn_it_was_trained_with(tmp_path):
    """GQA 4 / 2 widened to MHA's parameters, converted to MQA: matched again, the FFN would
    be wider than the weights; it keeps its width, and the uptrain command says so. By hand
    (d_model 32, 2 + 2 layers, heads of 8): GQA lacks K and V of 2 heads, 2 x 2 x (32 x 8 +
    8) = 1,056 parameters in each of 6 attention layers; an FFN unit costs 4 x (2 x 32 + 1)
    = 260: 24.4 units, 24 to a multiple of 8, so 64 + 24 = 88."""
    from helpers.ct2_models import save_checkpoint, tokenizer

    path = tmp_path / "matched.ckpt"
    heads = {"num_heads": 4, "num_kv_heads": 2, "backend": "sdpa"}
    trained = save_checkpoint(path, tokenizer(), attention=heads, match_parameters="mha")
    ckpt = torch.load(path, weights_only=False)
    config = ckpt["multihead"]["config"]  # as train.py stores it: set beside the heads
    config["attention"]["match_parameters"] = config["model"].pop("match_parameters")
    torch.save(ckpt, path)
    assert load_trained_model(path).model.ffn_dim == trained.ffn_dim == 88
    out = tmp_path / "mqa.ckpt"
    _, overrides = convert_kv_heads(path, 1, out, "all")
    converted = load_trained_model(out).model
    assert converted.ffn_dim == 88
    assert {c["num_kv_heads"] for c in converted.head_config.values()} == {1}
    assert {"attention.match_parameters=null", "model.ffn_dim=88"} <= set(overrides)


# ---------------------------------------------------------------------- real checkpoints
@pytest.fixture(scope="module")
def trained(tmp_path_factory, smoke_run_dir, multi30k_dir) -> Path:
    out = tmp_path_factory.mktemp("run")
    (out / "checkpoints").mkdir()
    shutil.copy(smoke_run_dir / "checkpoints" / "last.ckpt", out / "checkpoints" / "last.ckpt")
    # What Hydra records for a run started from the command line.
    (out / ".hydra").mkdir()
    (out / ".hydra" / "overrides.yaml").write_text(
        f"- experiment=smoke\n- data.local_dir={multi30k_dir}\n- paths.output_dir={out}\n"
        "- ckpt_path=null\n- logger=csv\n"
    )
    return out / "checkpoints" / "last.ckpt"


@pytest.mark.parametrize("scope", ["decoder", "all"])
def test_converted_checkpoint_round_trips(trained, tmp_path, scope) -> None:
    out = tmp_path / "converted.ckpt"
    written, overrides = convert_kv_heads(trained, 2, out, scope)
    assert written == out

    result = load_trained_model(out)
    heads = result.model.head_config
    expected_kv = {
        "encoder_self_attention": 2 if scope == "all" else 4,
        "decoder_self_attention": 2,
        "cross_attention": 2,
    }
    assert {kind: cfg["num_kv_heads"] for kind, cfg in heads.items()} == expected_kv

    # Written out: query rows kept; K/V head j of the result = mean of old heads 2j, 2j+1.
    old = load_trained_model(trained).model.state_dict()
    new = result.model.state_dict()
    E, D = 32, 8  # the smoke model: d_model 32, 4 heads
    converted = [
        f"{stack}.{i}.{attn}.in_proj"
        for stack, attn, kind in (
            ("encoder_layers", "self_attn", "encoder_self_attention"),
            ("decoder_layers", "self_attn", "decoder_self_attention"),
            ("decoder_layers", "cross_attn", "cross_attention"),
        )
        if kind in resolve_scope(scope)
        for i in range(2)
    ]
    for name, tensor in old.items():
        prefix = name.rsplit(".", 1)[0]
        if prefix not in converted:
            assert torch.equal(new[name], tensor), name
            continue
        rows = [tensor[:E]]
        for part in (0, 1):  # K, then V: 4 heads of D rows each
            start = E + part * 4 * D
            for j in range(2):
                a = tensor[start + 2 * j * D : start + (2 * j + 1) * D]
                b = tensor[start + (2 * j + 1) * D : start + (2 * j + 2) * D]
                rows.append((a + b) / 2)
        torch.testing.assert_close(new[name], torch.cat(rows), rtol=0, atol=1e-7)

    ckpt = read_checkpoint(out)
    assert ckpt["multihead"]["converted_from"] == {
        "path": str(trained),
        "num_kv_heads": 2,
        "scope": list(resolve_scope(scope)),
        "previous_num_kv_heads": {kind: 4 for kind in resolve_scope(scope)},
    }
    assert not {"optimizer_states", "lr_schedulers", "loops", "callbacks"} & set(ckpt)
    assert ckpt["global_step"] == read_checkpoint(trained)["global_step"]
    assert ckpt["multihead"]["config"]["attention"]["num_kv_heads"] == (
        2 if scope == "all" else None
    )

    # The printed overrides compose and rebuild the converted architecture.
    assert f"init_from={out}" in overrides
    assert not any(o.startswith(("ckpt_path=", "paths.output_dir=")) for o in overrides)
    composed = compose_config(
        "train",
        [*overrides, f"paths.output_dir={tmp_path}", f"paths.cache_dir={tmp_path / 'cache'}"],
    )
    assert composed.init_from == str(out)
    tok = result.tokenizer
    rebuilt = build_model(
        OmegaConf.to_container(composed, resolve=True), tok.vocab_size, tok.pad_id
    )
    assert rebuilt.head_config == heads
    rebuilt.load_state_dict(result.model.state_dict())


def test_converted_checkpoint_evaluates(trained, tmp_path, multi30k_dir) -> None:
    out = tmp_path / "mqa.ckpt"
    convert_kv_heads(trained, 1, out, ["decoder_self_attention"])
    result = evaluate_checkpoint(
        str(out), tmp_path, split="test", beam_size=2, limit=4, local_dir=str(multi30k_dir)
    )
    assert result["sentences"] == 4
    assert len((tmp_path / "hypotheses.test.txt").read_text().splitlines()) == 4


def test_latent_conversion_is_exact_at_full_rank_and_uptrains(trained, tmp_path) -> None:
    """MHA to MLA with r = the K/V stack's rank (d_model 32: r = 32): the same model."""
    out = tmp_path / "mla.ckpt"
    written, overrides = convert_kv_heads(trained, None, out, "decoder", kv_latent_dim=32)
    old, new = load_trained_model(trained).model, load_trained_model(written).model
    assert new.head_config["decoder_self_attention"]["tag"] == "mla4r32"
    assert new.head_config["encoder_self_attention"]["tag"] == "mha4"
    assert new.kv_cache_bytes_per_token() == 2 * 32 * 4  # 2 layers: the latent alone
    src = torch.randint(4, 100, (3, 9))
    tgt = torch.randint(4, 100, (3, 6))
    with torch.no_grad():
        torch.testing.assert_close(new(src, tgt), old(src, tgt), atol=1e-4, rtol=1e-4)
    assert "attention.decoder_self_attention.design=mla" in overrides
    assert "++attention.decoder_self_attention.design_options.kv_latent_dim=32" in overrides
    assert "attention.cross_attention.num_kv_heads=4" in overrides
    with pytest.raises(
        ValueError, match="set exactly one of num_kv_heads, kv_latent_dim and cache_budget"
    ):
        convert_checkpoint(trained, 2, kv_latent_dim=8)


def test_refuses_to_overwrite_and_bad_head_counts(trained, tmp_path) -> None:
    out = tmp_path / "exists.ckpt"
    out.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match="already exists"):
        convert_kv_heads(trained, 2, out)
    assert out.read_bytes() == b"precious"
    with pytest.raises(ValueError, match="cannot pool 4 K/V heads into 3"):
        convert_checkpoint(trained, 3)
    with pytest.raises(  # issue 74: it wrote the same model in silence
        ValueError, match=r"^num_kv_heads=4 would leave decoder_layers.0.self_attn as it is: it "
        r"has 4 K/V heads already$"
    ):  # fmt: skip
        convert_checkpoint(trained, 4)
    with pytest.raises(ValueError, match="unknown scope 'encoder'"):
        convert_checkpoint(trained, 2, "encoder")


def test_script_prints_uptrain_command_and_fails_in_one_line(trained, tmp_path, capsys) -> None:
    """The script's main in this process; the refusal runs the real script, in one line."""
    out = tmp_path / "gqa.ckpt"
    script_main(
        "convert_kv_heads.py",
        "convert",
        f"ckpt={trained}",
        "num_kv_heads=2",
        f"out={out}",
        "scope=[decoder_self_attention,cross_attention]",
    )
    assert out.is_file()
    command = capsys.readouterr().out.strip().splitlines()[-1]
    assert command.startswith("python scripts/train.py experiment=smoke")
    assert f"init_from={out}" in command
    assert "attention.cross_attention.num_kv_heads=2" in command

    again = run_script("convert_kv_heads.py", f"ckpt={trained}", "num_kv_heads=2", f"out={out}")
    assert again.returncode == 2
    assert again.stderr.strip() == f"error: {out} already exists; choose a new out= path"


def test_a_rotary_checkpoint_converts_to_mla_loads_and_its_uptrain_command_rebuilds_it(
    trained, tmp_path
) -> None:
    # The smoke run as a positional=rope model: RoPE has no parameters, so the state_dict fits.
    ckpt = read_checkpoint(trained)
    ckpt["multihead"]["config"]["model"]["positional"] = "rope"
    rope_run = tmp_path / "rope" / "checkpoints" / "last.ckpt"
    rope_run.parent.mkdir(parents=True)
    save_new(ckpt, rope_run)
    (tmp_path / "rope" / ".hydra").mkdir()
    recorded = trained.parent.parent / ".hydra" / "overrides.yaml"
    (tmp_path / "rope" / ".hydra" / "overrides.yaml").write_text(
        recorded.read_text() + "- model.positional=rope\n"
    )
    # Decoder self-attention: MHA, 4 heads of D = 8, rope_dim 4 of the 8 rotated features
    # kept: the latent factors 4 * 4 K and 4 * 8 V features of E = 32 (full rank 32), cache
    # 32 + 4 * 4.
    out = tmp_path / "mla.ckpt"
    written, overrides = convert_kv_heads(
        rope_run, None, out, ["decoder_self_attention"], kv_latent_dim=32, rope_dim=4
    )
    new = load_trained_model(written).model
    # 4 of each head's 8 features rotate, so its position-free Q/K width is 4; the converted
    # layer's scale and frequencies are not the defaults: a digest of them ends the tag.
    tag = new.head_config["decoder_self_attention"]["tag"]
    assert re.fullmatch(r"mla4r32rope4x4qk4-[0-9a-f]{6}", tag), tag
    assert new.decoder_layers[0].self_attn.kv_cache_bytes_per_token() == (32 + 16) * 4
    # rope_dim < 8: the 2 pairs kept are the fastest ("high"); the model differs (uptraining
    # recovers it), but every pair kept rotates at its frequency in the source's pairing.
    assert new.decoder_layers[0].self_attn.kv_latent.rope.inv_freq == ((1.0, 0.1),) * 4
    own = "++attention.decoder_self_attention.design_options."
    assert any(o.startswith(f"{own}rope_inv_freq=") for o in overrides)
    composed = compose_config(
        "train",
        [*overrides, f"paths.output_dir={tmp_path}", f"paths.cache_dir={tmp_path / 'cache'}"],
    )
    tok = load_trained_model(written).tokenizer
    rebuilt = build_model(
        OmegaConf.to_container(composed, resolve=True), tok.vocab_size, tok.pad_id
    )
    assert rebuilt.head_config == new.head_config
    rebuilt.load_state_dict(new.state_dict())
