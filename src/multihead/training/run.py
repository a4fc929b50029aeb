"""What ``scripts/train.py`` does, importable and testable: config in, trained model out."""

from __future__ import annotations

import json
import logging
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from lightning.pytorch.loggers import WandbLogger
from omegaconf import DictConfig, OmegaConf

from multihead.training.callbacks import ThroughputMonitor
from multihead.training.checkpoint import model_state_dict, read_checkpoint
from multihead.training.inference import translate
from multihead.training.precision import resolve_precision
from multihead.training.wandb_setup import configure_wandb_mode, finish_wandb

log = logging.getLogger(__name__)


def build_model(cfg: DictConfig, vocab_size: int, pad_id: int):
    """Instantiate ``cfg.model`` for a joint vocabulary of ``vocab_size``."""
    return instantiate(
        cfg.model, src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, pad_id=pad_id
    )


def initialise_from(model, path: str, tokenizer) -> None:
    """Load the network weights of checkpoint ``path`` into ``model`` (nothing else).

    Raises:
        ValueError: the checkpoint was trained with another tokenizer, or its weights do
            not fit ``model`` (e.g. other K/V head counts than the configured ones).
    """
    ckpt = read_checkpoint(path)
    if ckpt["multihead"]["tokenizer"] != tokenizer.to_str():
        raise ValueError(
            f"init_from={path} was trained with another tokenizer than this run's data "
            "settings produce; use the same data (name, languages, vocab_size, limits)"
        )
    state = model_state_dict(ckpt)
    mine = model.state_dict()
    for key, value in state.items():
        if key in mine and mine[key].shape != value.shape:
            raise ValueError(
                f"init_from={path}: {key} has shape {tuple(value.shape)} in the checkpoint but "
                f"{tuple(mine[key].shape)} in this model; match the model/attention settings "
                "(e.g. attention.decoder_self_attention.num_kv_heads) to the checkpoint's"
            )
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"init_from={path} does not fit this model: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}; match the model settings to the checkpoint's"
        )
    log.info("initialised the model from %s", path)


def model_summary(cfg: DictConfig, model) -> dict[str, Any]:
    """Figures worth a column in the runs table: head settings, sizes, KV-cache cost.

    The head settings are the decoder self-attention's, the sublayer whose K/V heads the
    decoding cache holds; ``head_tag`` spells out all three kinds.
    """
    heads = model.head_config["decoder_self_attention"]
    return {
        "run_name": cfg.run_name,
        "variant": heads["variant"],
        "num_heads": heads["num_heads"],
        "num_kv_heads": heads["num_kv_heads"],
        "backend": heads["backend"],
        "head_tag": model.head_tag,
        "params/total": model.num_parameters(),
        "params/attention": model.attention_parameters(),
        "kv_cache/bytes_per_token": model.kv_cache_bytes_per_token(),
    }


def decode_summary(
    module, datamodule, split: str, limit: int | None, beam_size: int, batch_size: int
) -> dict[str, float]:
    """Sentences per second of greedy and beam search (with the KV cache) on ``split``."""
    sentences = list(datamodule.tokenized[split]["src"])[:limit]
    model = module.model.eval()
    result = {}
    for name, beam in (("greedy", 1), (f"beam{beam_size}", beam_size)):
        start = time.perf_counter()
        with torch.inference_mode():
            translate(
                model,
                datamodule.tokenizer,
                sentences,
                beam_size=beam,
                batch_size=batch_size,
                max_len_a=module.decode_settings["max_len_a"],
                max_len_b=module.decode_settings["max_len_b"],
            )
        result[f"decode/{name}_sentences_per_s"] = len(sentences) / (time.perf_counter() - start)
    return result


def training_summary(trainer: pl.Trainer) -> dict[str, float]:
    """Whole-run training throughput and peak memory, from the ThroughputMonitor."""
    for callback in trainer.callbacks:
        if isinstance(callback, ThroughputMonitor):
            return callback.summary()
    return {}


def train(cfg: DictConfig) -> dict[str, float]:
    """Train (and by default test) as ``cfg`` says.

    Returns the run summary (also written to ``<run dir>/summary.json``): head settings,
    parameter counts, KV-cache bytes per token, training and decoding throughput, peak
    memory and the final metrics.
    """
    pl.seed_everything(cfg.seed, workers=True)
    # Lightning cannot see that our batch sampler resumes mid-epoch (the DataModule's
    # state_dict restores it), so its warning about it does not apply.
    warnings.filterwarnings("ignore", message=".*your dataloader is not resumable.*")
    run_dir = str(cfg.paths.output_dir)  # Hydra's job directory unless overridden
    if "wandb" in (cfg.get("logger") or {}):
        configure_wandb_mode(run_dir)

    datamodule = instantiate(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")
    datamodule.save_tokenizer(run_dir)

    model = build_model(cfg, datamodule.vocab_size, datamodule.pad_id)
    if cfg.get("init_from"):
        initialise_from(model, cfg.init_from, datamodule.tokenizer)
    config = OmegaConf.to_container(cfg, resolve=True)
    module = instantiate(cfg.module, model=model, tokenizer=datamodule.tokenizer)
    # Set after instantiate: Hydra would try to instantiate the _target_s inside it.
    module.run_config = config
    summary = model_summary(cfg, model)
    log.info("model: %s", summary)

    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values()]
    precision = resolve_precision(cfg.trainer.precision, cfg.trainer.accelerator)
    trainer: pl.Trainer = instantiate(
        cfg.trainer, precision=precision, callbacks=callbacks, logger=loggers or False
    )
    for logger in trainer.loggers:
        logger.log_hyperparams({**config, **summary, "precision": precision})

    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if cfg.get("test"):
            best = (
                trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
            )
            trainer.test(module, datamodule=datamodule, ckpt_path=best or None)
            metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
        summary.update(training_summary(trainer))
        if cfg.summary.decode_speed:
            summary.update(
                decode_summary(
                    module,
                    datamodule,
                    cfg.summary.split,
                    cfg.summary.limit,
                    cfg.summary.beam_size,
                    cfg.summary.batch_size,
                )
            )
        summary.update(metrics)
        write_summary(run_dir, summary, trainer)
    finally:
        finish_wandb()
    log.info("run directory: %s", run_dir)
    return summary


def write_summary(run_dir: str, summary: dict[str, Any], trainer: pl.Trainer) -> None:
    """``summary.json`` in the run directory, and the same figures in wandb's run summary."""
    path = Path(run_dir) / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            logger.experiment.summary.update(summary)
    log.info("summary: %s", json.dumps(summary, sort_keys=True))
