"""What ``scripts/train.py`` does, importable and testable: config in, trained model out."""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
from hydra.utils import instantiate
from lightning.pytorch.loggers import WandbLogger
from omegaconf import DictConfig, OmegaConf

from multihead.training.precision import resolve_precision
from multihead.training.wandb_setup import configure_wandb_mode, finish_wandb

log = logging.getLogger(__name__)


def build_model(cfg: DictConfig, vocab_size: int, pad_id: int):
    """Instantiate ``cfg.model`` for a joint vocabulary of ``vocab_size``."""
    return instantiate(
        cfg.model, src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, pad_id=pad_id
    )


def run_summary(model) -> dict[str, Any]:
    """Figures worth a column in the runs table: sizes and the KV-cache cost."""
    return {
        "params/total": model.num_parameters(),
        "params/attention": model.attention_parameters(),
        "kv_cache/bytes_per_token_fp32": model.kv_cache_bytes_per_token(),
    }


def train(cfg: DictConfig) -> dict[str, float]:
    """Train (and by default test) as ``cfg`` says; return the final metrics."""
    pl.seed_everything(cfg.seed, workers=True)
    run_dir = str(cfg.paths.output_dir)  # Hydra's job directory unless overridden
    if "wandb" in (cfg.get("logger") or {}):
        configure_wandb_mode(run_dir)

    datamodule = instantiate(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")
    datamodule.save_tokenizer(run_dir)

    model = build_model(cfg, datamodule.vocab_size, datamodule.pad_id)
    config = OmegaConf.to_container(cfg, resolve=True)
    module = instantiate(cfg.module, model=model, tokenizer=datamodule.tokenizer)
    # Set after instantiate: Hydra would try to instantiate the _target_s inside it.
    module.run_config = config
    summary = run_summary(model)
    log.info("model: %s", model.head_config)
    log.info("parameters: %s", summary)

    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
    loggers = [instantiate(c) for c in (cfg.get("logger") or {}).values()]
    precision = resolve_precision(cfg.trainer.precision, cfg.trainer.accelerator)
    trainer: pl.Trainer = instantiate(
        cfg.trainer, precision=precision, callbacks=callbacks, logger=loggers or False
    )
    for logger in trainer.loggers:
        logger.log_hyperparams({**config, **summary, "precision": precision})
        if isinstance(logger, WandbLogger):
            logger.experiment.summary.update(summary)  # comparable in wandb's runs table

    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if cfg.get("test"):
            best = (
                trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
            )
            trainer.test(module, datamodule=datamodule, ckpt_path=best or None)
            metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    finally:
        finish_wandb()
    log.info("run directory: %s", run_dir)
    return metrics
