"""Attention maps and head similarity: per-head outputs, the metric, the callback's files."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.loggers import WandbLogger

from multihead.analysis.diagnostics import AttentionMapLogger
from multihead.analysis.heads import head_outputs, head_similarity, head_similarity_matrix
from multihead.attention import MultiHeadAttention
from multihead.data import Tokenizer, collate
from multihead.model import Transformer

from helpers.models import SENTENCES, analysis_model
from helpers.scripts import run_script, script_main
from helpers.training import compose_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train([t for pair in SENTENCES for t in pair] * 5, vocab_size=300)


def examples(tokenizer: Tokenizer) -> list[dict]:
    return [
        {
            "src": src,
            "tgt": tgt,
            "src_ids": tokenizer.encode(src),
            "tgt_ids": tokenizer.encode(tgt),
        }
        for src, tgt in SENTENCES
    ]


@pytest.mark.parametrize(
    "backend, design, kv_latent_dim",
    [
        ("sdpa", None, None),
        ("math", "talking_heads", None),
        ("sdpa", "group_mlp", None),
        ("sdpa", "head_attention", None),
        ("sdpa", None, 6),  # latent attention: V from the latent, one per query head
    ],
)
def test_head_outputs_recombine_into_each_layers_output(
    tokenizer, backend, design, kv_latent_dim
) -> None:
    model = analysis_model(
        tokenizer.vocab_size, backend, design=design, kv_latent_dim=kv_latent_dim
    )
    with torch.no_grad():  # move the mixings off their identity start, so they count
        for name, param in model.named_parameters():
            if ".head_mix." in name:
                param.add_(0.3 * torch.randn_like(param))
    batch = collate(examples(tokenizer), pad_id=0, bos_id=1, eos_id=2)
    src, tgt_in = batch["src"], batch["tgt"][:, :-1]
    layer_outputs = {}

    def record(module, args, out) -> None:  # the first call: the plain forward
        layer_outputs.setdefault(module, out)

    hooks = [
        module.register_forward_hook(record)
        for module in model.modules()
        if isinstance(module, MultiHeadAttention)
    ]
    with torch.no_grad():
        model(src, tgt_in)  # the layers' own forward
        maps, outputs = head_outputs(model, src, tgt_in)
    for hook in hooks:
        hook.remove()

    sublayers = {
        "encoder_self": [layer.self_attn for layer in model.encoder_layers],
        "decoder_self": [layer.self_attn for layer in model.decoder_layers],
        "cross": [layer.cross_attn for layer in model.decoder_layers],
    }
    for kind, attns in sublayers.items():
        assert len(maps[kind]) == len(outputs[kind]) == 2
        for attn, heads in zip(attns, outputs[kind], strict=True):
            B, H, L, D = heads.shape
            assert H == 4 and D == 4
            recombined = attn.out_proj(heads.transpose(1, 2).reshape(B, L, H * D))
            torch.testing.assert_close(recombined, layer_outputs[attn])


def test_head_similarity_extremes_and_hand_computation() -> None:
    torch.manual_seed(0)
    one = torch.randn(2, 1, 5, 3)
    assert head_similarity(one.expand(2, 4, 5, 3)) == pytest.approx(1.0)
    assert head_similarity(torch.cat([one, -one], dim=1)) == pytest.approx(-1.0)
    assert head_similarity(one) != head_similarity(one)  # NaN: a single head

    heads = torch.randn(1, 3, 2, 4)
    mask = torch.tensor([[True, False]])  # only the first query position is real
    h = heads[0, :, 0]
    cos = torch.nn.functional.cosine_similarity
    expected = (cos(h[0], h[1], dim=0) + cos(h[0], h[2], dim=0) + cos(h[1], h[2], dim=0)) / 3
    assert head_similarity(heads, mask) == pytest.approx(float(expected), abs=1e-6)


def test_similarity_matrix_by_hand_and_a_silent_head() -> None:
    torch.manual_seed(1)
    heads = torch.randn(2, 3, 4, 5)
    heads[1, 2, 1] = 0.0  # head 2 is off at one position (a sparse head not selected there)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    cos = torch.nn.functional.cosine_similarity
    expected = torch.zeros(3, 3)
    positions = [(b, q) for b in range(2) for q in range(4) if mask[b, q]]
    for h in range(3):
        for k in range(3):
            values = [cos(heads[b, h, q], heads[b, k, q], dim=0) for b, q in positions]
            expected[h, k] = sum(float(v) for v in values) / len(positions)
    torch.testing.assert_close(head_similarity_matrix(heads, mask), expected)


@pytest.mark.slow  # the script and a process; its parts above
def test_head_diversity_script_writes_figures_and_table(smoke_run_dir, multi30k_dir, tmp_path):
    """The script's main in this process; a bad argument ends the real script in one line."""
    ckpt = smoke_run_dir / "checkpoints" / "last.ckpt"
    script_main(
        "head_diversity.py",
        "head_diversity",
        f"ckpts=[{ckpt}]",
        "labels=[smoke]",
        f"out={tmp_path}",
        "sentences=8",
        f"data.local_dir={multi30k_dir}",
    )
    assert (tmp_path / "smoke_head_similarity.png").stat().st_size > 0
    table = (tmp_path / "head_diversity.md").read_text().splitlines()
    assert len(table) == 2 + 3  # header, rule, one row per sublayer kind
    bad = run_script("head_diversity.py", f"ckpts=[{ckpt}]", "labels=[a,b]", f"out={tmp_path}")
    assert bad.returncode == 2 and "expected one label per checkpoint" in bad.stderr


class RecordingWandb(WandbLogger):
    """A WandbLogger that records calls instead of starting a wandb run."""

    def __init__(self) -> None:
        self.metrics: list[dict] = []
        self.images: dict[str, tuple[list, list]] = {}

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append(dict(metrics))

    def log_image(self, key, images, step=None, **kwargs) -> None:
        self.images[key] = (images, kwargs["caption"])


def fake_run(tokenizer: Tokenizer, model: Transformer, root: Path):
    trainer = SimpleNamespace(
        sanity_checking=False,
        is_global_zero=True,
        global_step=7,
        default_root_dir=str(root),
        log_dir=None,
        loggers=[RecordingWandb()],
        datamodule=SimpleNamespace(tokenized={"validation": examples(tokenizer)}),
    )
    module = SimpleNamespace(model=model.train(), tokenizer=tokenizer, device=torch.device("cpu"))
    return trainer, module


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_callback_writes_maps_and_logs_similarity(tokenizer, tmp_path, backend) -> None:
    model = analysis_model(tokenizer.vocab_size, backend, layers=1)
    trainer, module = fake_run(tokenizer, model, tmp_path)
    callback = AttentionMapLogger(num_sentences=2, max_tokens_shown=5)
    callback.on_validation_end(trainer, module)

    out = tmp_path / "attention_maps"
    names = sorted(p.name for p in out.iterdir())
    expected = sorted(
        [
            f"step7_{kind}_layer{i}_sent{j}.png"
            for kind in ("encoder_self", "decoder_self", "cross")
            for i in range(1)
            for j in range(2)
        ]
        + ["step7_head_similarity.png"]
    )
    assert names == expected
    for path in out.iterdir():
        assert path.read_bytes()[:8] == PNG_MAGIC
    assert model.training  # the train/eval mode is restored

    similarity = callback.last_similarity
    assert {kind: len(v) for kind, v in similarity.items()} == {
        "encoder_self": 1,
        "decoder_self": 1,
        "cross": 1,
    }
    assert all(-1.0 <= s <= 1.0 for values in similarity.values() for s in values)
    logger = trainer.loggers[0]
    assert logger.metrics[0]["diagnostics/head_similarity/cross/layer0"] == similarity["cross"][0]
    images, captions = logger.images["attention_maps/encoder_self/layer0"]
    assert len(images) == 2 and captions == [SENTENCES[0][0], SENTENCES[1][0]]
    assert "diagnostics/head_similarity" in logger.images


def test_callback_skips_sanity_check_and_honours_every_n_val(tokenizer, tmp_path) -> None:
    trainer, module = fake_run(tokenizer, analysis_model(tokenizer.vocab_size, layers=1), tmp_path)
    callback = AttentionMapLogger(num_sentences=1, every_n_val=2, out_dir=str(tmp_path / "maps"))
    trainer.sanity_checking = True
    callback.on_validation_end(trainer, module)
    assert not (tmp_path / "maps").exists()
    trainer.sanity_checking = False
    for step in (10, 20, 30):
        trainer.global_step = step
        callback.on_validation_end(trainer, module)
    steps = {p.name.split("_")[0] for p in (tmp_path / "maps").iterdir()}
    assert steps == {"step10", "step30"}


def test_bad_arguments_fail_clearly() -> None:
    with pytest.raises(ValueError, match="num_sentences must be >= 1, got 0"):
        AttentionMapLogger(num_sentences=0)


def test_diagnostics_callbacks_config_extends_default(tmp_path) -> None:
    cfg = compose_config(
        "train",
        ["callbacks=diagnostics", f"paths.output_dir={tmp_path}", f"paths.cache_dir={tmp_path}"],
    )
    default = compose_config("train", [f"paths.output_dir={tmp_path}"])
    assert set(cfg.callbacks) == set(default.callbacks) | {"attention_maps"}
    callback = instantiate(cfg.callbacks.attention_maps)
    assert isinstance(callback, AttentionMapLogger)
    assert callback.out_dir == str(tmp_path / "attention_maps")
