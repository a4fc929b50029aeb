"""Every config option composes and instantiates, and each of its keys is read (a typo in an
option's name: test_train_script.py; a key that no code reads: test_bad_input.py).

Bad values are tested where they are raised (tests/training/test_bad_input.py lists where).
"""

from __future__ import annotations

import re
from pathlib import Path

from multihead.cli import RefuseUnreadKeys, unread_constructor_keys

import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch import Trainer
from omegaconf import OmegaConf

from multihead.attention.designs import design_class
from multihead.model import build_model
from multihead.training.precision import resolve_precision

from helpers import CONFIG_DIR, REPO_ROOT
from helpers.training import compose_config


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml"))


def base(tmp_path: Path) -> list[str]:
    return [f"paths.output_dir={tmp_path}", f"paths.cache_dir={tmp_path / 'cache'}"]


# The translation models; the decoder-only ones (decoder_lm, llama_lm) are tested below.
TRANSLATION_MODELS = [m for m in options("model") if m.startswith("transformer")]
LM_DATA = ("documents", "mqar", "lm_multi30k")  # tested in tests/data and tests/scripts
# Presets whose widths are the decoder-only LM's (d_model 128: MQAR's controls).
LM_ATTENTION = ("mla_h8_r24_qk8",)


GROUPS = ("data", "model", "attention", "trainer", "logger", "callbacks", "module", "budget")


def _plain_keys(node: dict, prefix: str = "") -> list[str]:
    """The dotted keys of ``node`` outside ``_target_`` nodes (their targets read those)."""
    if "_target_" in node:
        return []
    keys = []
    for key, value in node.items():
        if isinstance(value, dict) and value:
            keys += _plain_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


@pytest.mark.slow  # composes every config: 10 s of CPU
def test_every_key_of_every_training_config_is_read(tmp_path) -> None:
    """Each option of each group and each experiment: a ``_target_`` node's keys are its
    target's parameters (the check the scripts run); the other keys (``seed``,
    ``summary.decode_speed``, ...) are read by the package or the scripts by name
    (``cfg.seed``, ``s.limit``, ``.get("ckpt_path")``) or by an interpolation of the configs.
    ``attention`` is read whole by the model, which refuses keys it does not take
    (tests/model/test_transformer.py)."""
    files = [p for d in ("src", "scripts") for p in (REPO_ROOT / d).rglob("*.py")]
    code = "\n".join(p.read_text() for p in files)
    yaml = "\n".join(p.read_text() for p in Path(CONFIG_DIR).rglob("*.yaml"))
    chosen = [[f"{g}={o}"] for g in GROUPS for o in options(g)]
    chosen += [[f"experiment={e}"] for e in options("experiment")]
    for choice in chosen:
        cfg = compose_config("train", [*choice, *base(tmp_path)])
        config = OmegaConf.to_container(cfg, resolve=False)
        assert unread_constructor_keys(config) == [], choice
        for key in _plain_keys({k: v for k, v in config.items() if k != "attention"}):
            name = re.escape(key.split(".")[-1])
            by_code = re.search(rf"\.{name}\b|get\(\"{name}\"|\[\"{name}\"\]", code)
            by_yaml = re.search(rf"\$\{{[^}}]*\b{re.escape(key)}\b", yaml)
            assert by_code or by_yaml, f"{key} ({choice}) is read by no code"


def test_every_scripts_config_refuses_keys_that_no_code_reads() -> None:
    """The one mechanism: each config a script's ``hydra.main`` composes has the callback."""
    scripts = (REPO_ROOT / "scripts").glob("*.py")
    names = [m for p in scripts for m in re.findall(r'config_name="(\w+)"', p.read_text())]
    assert len(names) >= 12
    for name in names:
        callbacks = OmegaConf.load(Path(CONFIG_DIR) / f"{name}.yaml").hydra.callbacks
        targets = [c._target_ for c in callbacks.values()]
        assert f"{RefuseUnreadKeys.__module__}.{RefuseUnreadKeys.__name__}" in targets, name


@pytest.mark.parametrize("attention", options("attention"))
@pytest.mark.parametrize("model", [*TRANSLATION_MODELS, "decoder_lm"])
def test_model_and_attention_options_instantiate(model, attention, tmp_path) -> None:
    """Every layer has the heads its preset names: H, G, the design and the design's options
    (each design's tag and formula are tested in tests/attention, so a new preset needs
    nothing here); the decoder-only LM takes every preset as the Transformer does."""
    lm = ["experiment=lm_long"] if model == "decoder_lm" else []
    overrides = [*lm, f"model={model}", f"attention={attention}", *base(tmp_path)]
    if attention in LM_ATTENTION and not lm:  # the LM's widths (16 per head)
        cfg = compose_config("train", [*overrides, "model.positional=rope"])
        if cfg.model.d_model // cfg.attention.num_heads > 16:  # wider heads: refused by name
            with pytest.raises(Exception, match=r"qk_head_dim \+ rotary_dim must be at least"):
                build_model(OmegaConf.to_container(cfg, resolve=True), vocab_size=100, pad_id=0)
            return
    cfg = compose_config("train", overrides)
    if not lm and cfg.attention.get("rotary_dim") is not None:  # a preset with a rotary key
        cfg = compose_config("train", [*overrides, "model.positional=rope"])
    net = build_model(OmegaConf.to_container(cfg, resolve=True), vocab_size=100, pad_id=0)
    heads = cfg.attention
    H, G = heads.num_heads, heads.num_kv_heads or heads.num_heads
    design = None if heads.design is None else design_class(heads.design)
    kind = "mha" if G == H else "mqa" if G == 1 else "gqa"  # as the layer's docstring says
    kind = getattr(design, "kind", None) or kind  # a design of its own kind: MLA's "mla"
    asked = {k: v for k, v in heads.design_options.items() if v is not None}
    for *_, attn in net.attention_sublayers():
        assert (attn.head_config["kind"], attn.num_heads, attn.num_kv_heads) == (kind, H, G)
        assert type(attn.design) is (type(None) if design is None else design)
        assert asked.items() <= (attn.design.options if design else {}).items()
    if lm:
        assert net(torch.randint(4, 100, (2, 5))).shape == (2, 5, 100)
        return
    logits = net(torch.randint(4, 100, (2, 5)), torch.randint(4, 100, (2, 4)))
    assert logits.shape == (2, 4, 100)


def test_the_hf_llama_lm_takes_heads_alone_from_the_attention_group(tmp_path) -> None:
    cfg = compose_config(
        "train", ["experiment=lm_multi30k", "attention=gqa_h8_kv2", *base(tmp_path)]
    )
    net = build_model(OmegaConf.to_container(cfg, resolve=True), vocab_size=100, pad_id=0)
    assert (net.config.num_attention_heads, net.config.num_key_value_heads) == (8, 2)
    for asked in ("attention=mla", "attention.backend=math"):  # HF's eager code runs, not ours
        cfg = compose_config("train", ["experiment=lm_multi30k", asked, *base(tmp_path)])
        with pytest.raises(ValueError, match=r"model=llama_lm\) takes only its heads from"):
            build_model(OmegaConf.to_container(cfg, resolve=True), vocab_size=100, pad_id=0)


@pytest.mark.parametrize("data", [d for d in options("data") if d not in LM_DATA])
def test_data_options_instantiate(data, tmp_path) -> None:
    cfg = compose_config("train", [f"data={data}", *base(tmp_path)])
    dm = instantiate(cfg.data)
    assert dm.src_lang == cfg.data.src_lang and dm.tgt_lang == cfg.data.tgt_lang


@pytest.mark.parametrize("data", ["iwslt2017", "wmt14"])
def test_hub_datasets_fail_clearly_offline(data, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cfg = compose_config("train", [f"data={data}", *base(tmp_path)])
    with pytest.raises(ValueError, match="local_dir"):
        instantiate(cfg.data).prepare_data()


@pytest.mark.parametrize("trainer", options("trainer"))
def test_trainer_options_instantiate(trainer, tmp_path) -> None:
    cfg = compose_config("train", [f"trainer={trainer}", *base(tmp_path)])
    if cfg.trainer.accelerator == "gpu" and not torch.cuda.is_available():
        pytest.skip(f"trainer={trainer} needs a CUDA GPU")
    precision = resolve_precision(cfg.trainer.precision, cfg.trainer.accelerator)
    assert isinstance(instantiate(cfg.trainer, precision=precision), Trainer)


@pytest.mark.parametrize("logger", options("logger"))
def test_logger_options_instantiate(logger, tmp_path) -> None:
    cfg = compose_config("train", [f"logger={logger}", *base(tmp_path)])
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values()]
    assert len(loggers) == {"none": 0, "wandb_csv": 2}.get(logger, 1)


def test_callbacks_and_module_instantiate(tmp_path) -> None:
    cfg = compose_config("train", base(tmp_path))
    callbacks = [instantiate(c) for c in cfg.callbacks.values()]
    assert len(callbacks) == len(cfg.callbacks)
    optimizer = instantiate(cfg.module.optimizer)([torch.nn.Parameter(torch.zeros(1))])
    scheduler = instantiate(cfg.module.scheduler)(optimizer, time_left=lambda: None)
    assert scheduler.get_last_lr()[0] == pytest.approx(3e-3 / 800)  # the recipe's peak, warmup
    assert optimizer.defaults["fused"] is True  # 32-true on CPU (auto)


@pytest.mark.parametrize(
    "precision, fused", [("auto", True), ("32-true", True), ("bf16-mixed", False)]
)
def test_adam_is_fused_only_at_full_precision(precision, fused, tmp_path) -> None:
    # Lightning refuses gradient clipping with a fused optimiser under mixed precision.
    cfg = compose_config("train", [f"trainer.precision={precision}", *base(tmp_path)])
    assert cfg.module.optimizer.fused is fused


def test_required_overrides_compose(tmp_path) -> None:
    cfg = compose_config(
        "train",
        [
            "attention=gqa",
            "attention.num_kv_heads=2",
            "attention.backend=flash",
            "attention.num_heads=8",
            "trainer.max_steps=7",
            "trainer.precision=bf16-mixed",
            "data.local_dir=/some/dir",
            "data.src_lang=de",
            "data.tgt_lang=en",
            "logger=csv",
            *base(tmp_path),
        ],
    )
    heads = {k: cfg.attention[k] for k in ("num_heads", "num_kv_heads", "backend")}
    assert heads == {"num_heads": 8, "num_kv_heads": 2, "backend": "flash"}
    assert "attention" not in cfg.model  # heads are set in one place
    assert (cfg.data.src_lang, cfg.data.tgt_lang, cfg.data.local_dir) == ("de", "en", "/some/dir")
    assert cfg.trainer.max_steps == 7 and cfg.trainer.precision == "bf16-mixed"


@pytest.mark.parametrize("direction", [("en", "de"), ("de", "en")])
def test_multi30k_recipe_composes(direction, tmp_path) -> None:
    """The recipe is the fairseq transformer_tiny shape under a wall-clock limit."""
    src, tgt = direction
    cfg = compose_config(
        "train",
        [
            "experiment=multi30k_en_de",
            f"data.src_lang={src}",
            f"data.tgt_lang={tgt}",
            *base(tmp_path),
        ],
    )
    assert cfg.task_name == f"multi30k_{src}_{tgt}"
    model = cfg.model
    assert (model.d_model, model.ffn_dim, model.num_encoder_layers, model.num_decoder_layers) == (
        128,
        256,
        4,
        4,
    )
    assert cfg.attention.num_heads == 4 and not model.norm_first and model.dropout == 0.3
    assert cfg.module.scheduler.cooldown_minutes == 30 and cfg.module.scheduler.cooldown_steps == 0
    assert cfg.test_ckpt == "avg10" and cfg.module.test_beam_size == 5
    assert model.share_embeddings and model.tie_output
    assert cfg.callbacks.checkpoint_recent.save_top_k == 10
    assert 60 in cfg.callbacks.wall_clock.save_at_minutes
    trainer = instantiate(cfg.trainer, precision="32-true", logger=False)
    assert trainer.max_steps == 20000
    # Lightning turns max_time into a Timer callback that stops the run at 1 h 50 min.
    (timer,) = [c for c in trainer.callbacks if type(c).__name__ == "Timer"]
    assert timer._duration == 110 * 60


def test_multi30k_recipe_gpu_variant_composes(tmp_path) -> None:
    cfg = compose_config("train", ["experiment=multi30k_en_de", "trainer=gpu", *base(tmp_path)])
    assert cfg.trainer.accelerator == "gpu" and cfg.trainer.precision == "auto"
    assert cfg.trainer.max_time == "00:01:50:00"
