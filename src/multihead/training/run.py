"""What ``scripts/train.py`` does, importable and testable: config in, trained model out."""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.strategies import FSDPStrategy
from omegaconf import DictConfig, OmegaConf

from multihead.attention.checks import check_bool
from multihead.checkpoints import (
    load_trained_model,
    model_state_dict,
    read_checkpoint,
    write_atomically,
)
from multihead.checkpoints.averaging import average_checkpoints, recent_checkpoints
from multihead.checkpoints.resume import resume_checkpoint
from multihead.evaluation import translate
from multihead.host import boot_id, cpu_model, host_name, utc_now
from multihead.model import build_model, check_model_config
from multihead.training.callbacks import RecentCheckpoints, TokenThroughput
from multihead.training.checkpoint_io import AtomicCheckpointIO
from multihead.training.precision import trainer_precision
from multihead.wandb_setup import configure_wandb_mode, finish_wandb

log = logging.getLogger(__name__)


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
            "settings produce; use the same data (name, languages, vocab_size, lowercase, limits)"
        )
    state = model_state_dict(ckpt)
    mine = model.state_dict()
    for key, value in state.items():
        if key in mine and mine[key].shape != value.shape:
            raise ValueError(
                f"init_from={path}: {key} has shape {tuple(value.shape)} in the checkpoint but "
                f"{tuple(mine[key].shape)} in this model; match the attention settings "
                "(e.g. attention.decoder_self_attention.num_kv_heads) to the checkpoint's"
            )
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"init_from={path} does not fit this model: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}; match the model settings to the checkpoint's"
        )
    log.info("initialised the model from %s", path)


def load_teacher(path: str, tokenizer) -> torch.nn.Module:
    """The network of checkpoint ``path``, to distil from (``distill_from``), eval mode.

    Raises:
        ValueError: the checkpoint was trained with another tokenizer (its outputs would be
            over other token ids).
    """
    if read_checkpoint(path)["multihead"]["tokenizer"] != tokenizer.to_str():
        raise ValueError(
            f"distill_from={path} was trained with another tokenizer than this run's data "
            "settings produce: its next-token distributions are over other ids"
        )
    log.info("distilling from %s", path)
    return load_trained_model(path).model.eval()


def model_summary(model) -> dict[str, Any]:
    """Figures worth a column in the runs table, all read from the built model.

    The head settings are the decoder self-attention's, the sublayer whose K/V heads the
    decoding cache holds; ``head_tag`` (also the run name) spells out all three kinds.
    """
    if not hasattr(model, "head_config"):  # a Hugging Face causal LM (experiment=lm_multi30k)
        config = model.config
        H, G = config.num_attention_heads, config.num_key_value_heads
        kind = "mha" if G == H else "mqa" if G == 1 else "gqa"
        tag = f"{config.model_type}-{kind}{H}" + (f"kv{G}" if kind == "gqa" else "")
        return {
            "run_name": tag, "head_tag": tag, "kind": kind, "num_heads": H, "num_kv_heads": G,
            "params/total": sum(p.numel() for p in model.parameters()),
        }  # fmt: skip
    heads = model.head_config["decoder_self_attention"]
    fractions = [attn.active_head_fraction for *_, attn in model.attention_sublayers()]
    return {
        "run_name": model.head_tag,
        "kind": heads["kind"],
        "tag": heads["tag"],
        "heads/active_fraction": sum(fractions) / len(fractions),
        "num_heads": heads["num_heads"],
        "num_kv_heads": heads["num_kv_heads"],
        "kv_latent_dim": heads.get("kv_latent_dim"),
        "backend": heads["backend"],
        "backend_reroute": heads.get("backend_reroute"),
        "head_tag": model.head_tag,
        "params/total": model.num_parameters(),
        "params/attention": model.attention_parameters(),
        "ffn_dim": model.ffn_dim,  # a parameter-matched control's is wider than its design's
        "kv_cache/bytes_per_token": model.kv_cache_bytes_per_token(),
    }


def decode_summary(
    module,
    datamodule,
    device: torch.device,
    cfg: DictConfig,
    precision_context: Callable[[], AbstractContextManager] = nullcontext,
) -> dict[str, float]:
    """Sentences per second of greedy and beam search (with the KV cache) on ``device``.

    Decoding runs under ``precision_context``: the training's precision (its precision
    plugin's ``forward_context``, the autocast of bf16-mixed or 16-mixed). Each search first
    decodes one untimed batch, so that the time leaves out CUDA's initialisation, the first
    kernel choices and compilations (e.g. FlexAttention's).
    """
    s = cfg.summary
    sentences = list(datamodule.tokenized[s.split]["src"])[: s.limit]
    # Lightning's teardown has moved the model to the CPU; a GPU run is measured on its GPU.
    model = module.model.to(device).eval()
    result = {}
    for name, beam in (("greedy", 1), (f"beam{s.beam_size}", s.beam_size)):

        def search(batch: list[str], beam: int = beam) -> None:
            with torch.inference_mode(), precision_context():
                translate(
                    model,
                    datamodule.tokenizer,
                    batch,
                    beam_size=beam,
                    batch_size=s.batch_size,
                    **module.decode_settings,
                )
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        search(sentences[: s.batch_size])  # warm-up, untimed
        start = time.perf_counter()
        search(sentences)
        result[f"decode/{name}_sentences_per_s"] = len(sentences) / (time.perf_counter() - start)
    return result


def build_loggers(cfg: DictConfig, head_tag: str, wandb_id: str | None) -> list:
    """The configured loggers; a wandb run is named and tagged after the built model's
    heads (``head_tag``)."""
    loggers = []
    for logger_cfg in (cfg.get("logger") or {}).values():
        extra = {}
        if str(logger_cfg.get("_target_", "")).endswith("WandbLogger"):
            extra = {"name": head_tag, "tags": head_tag.split("_")}
            if wandb_id is not None:  # a resumed job continues its wandb run's charts
                extra |= {"id": wandb_id, "resume": "allow"}
        loggers.append(instantiate(logger_cfg, **extra))
    return loggers


def build_callbacks(cfg: DictConfig, loggers: list) -> list:
    """The configured callbacks; ``callbacks.NAME=null`` leaves one out.

    Without a logger (``logger=none``) the learning-rate monitor is left out too: it only
    writes to loggers, and Lightning refuses to start it without one.
    """
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    if not loggers:
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    return callbacks


def test_checkpoint(trainer: pl.Trainer, setting: str) -> str:
    """The checkpoint that ``test_ckpt`` names: ``best``, ``last``, ``avg<N>`` or a path.

    ``avg<N>`` averages the newest N step checkpoints into ``checkpoints/avg<N>.ckpt``
    (on rank 0; the other ranks wait for the file).
    """
    recent = next((c for c in trainer.callbacks if isinstance(c, RecentCheckpoints)), None)
    if setting == "best":
        best = [
            c.best_model_path
            for c in trainer.checkpoint_callbacks
            if isinstance(c, ModelCheckpoint) and not isinstance(c, RecentCheckpoints)
        ]
        if not best or not best[0]:
            raise ValueError("test_ckpt=best needs a ModelCheckpoint on val/bleu (checkpoint_best)")
        return best[0]
    if setting in ("last",) or setting.startswith("avg"):
        if recent is None:
            raise ValueError(
                f"test_ckpt={setting} needs the RecentCheckpoints callback (checkpoint_recent)"
            )
        if setting == "last":
            return f"{recent.dirpath}/last.ckpt"
        if not setting[3:].isdigit() or int(setting[3:]) < 1:
            raise ValueError(f"test_ckpt={setting}; expected best, last, avg<N> (N >= 1) or a path")
        out = Path(recent.dirpath) / f"{setting}.ckpt"
        if trainer.is_global_zero:
            averaged = average_checkpoints(recent_checkpoints(recent.dirpath, int(setting[3:])))
            write_atomically(out, lambda f: torch.save(averaged, f))
        trainer.strategy.barrier()
        return str(out)
    if not Path(setting).is_file():
        raise FileNotFoundError(
            f"test_ckpt={setting}: no such checkpoint; expected best, last, avg<N> or a path"
        )
    return setting


def train(cfg: DictConfig) -> dict[str, float]:
    """Train (and by default test) as ``cfg`` says.

    Returns the run summary (also written to ``<run dir>/summary.json``): head settings,
    parameter counts, KV-cache bytes per token, training and decoding throughput, peak
    memory, the final metrics, and when and where the run ran (``run/start``, ``run/end``,
    ``run/host``, ``run/boot_id``, ``run/cpu``: ``scripts/compare.py`` tells from them
    whether runs shared a machine at the same time, which makes their speeds meaningless;
    ``run/threads`` and ``run/cpu_capability``: with the command and seed, what decides the
    weights' bits). The test split's outputs go to ``<run dir>/hypotheses.test.txt``, one
    line per source sentence, in order.
    """
    # Lightning cannot see that our training data resumes mid-epoch (every DataModule's
    # state_dict holds its position), so its warning about it does not apply.
    warnings.filterwarnings("ignore", message=".*your dataloader is not resumable.*")
    objective = cfg.get("objective", "translation")
    if objective == "causal_lm":
        return train_language_model(cfg)
    if objective != "translation":
        raise ValueError(f"objective={objective!r}; expected translation or causal_lm")
    check_bool("test", cfg.get("test", False))
    check_bool("summary.decode_speed", cfg.summary.decode_speed)
    started = utc_now()
    pl.seed_everything(cfg.seed, workers=True)
    run_dir = str(cfg.paths.output_dir)  # Hydra's job directory unless overridden
    ckpt_path, wandb_id = resume_checkpoint(cfg.get("ckpt_path"), Path(run_dir) / "checkpoints")
    if "wandb" in (cfg.get("logger") or {}):
        configure_wandb_mode(run_dir)
    config = OmegaConf.to_container(cfg, resolve=True)
    check_model_config(config)  # the model's settings (a design with its backend) before data

    datamodule = instantiate(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")
    datamodule.save_tokenizer(run_dir)

    model = build_model(config, datamodule.vocab_size, datamodule.pad_id)
    if cfg.get("init_from"):
        initialise_from(model, cfg.init_from, datamodule.tokenizer)
    teacher = {}
    if cfg.get("distill_from"):  # uptraining a conversion from the checkpoint before it
        teacher = {"teacher": load_teacher(cfg.distill_from, datamodule.tokenizer)}
    module = instantiate(cfg.module, model=model, tokenizer=datamodule.tokenizer, **teacher)
    # Set after instantiate: Hydra would try to instantiate the _target_s inside it.
    module.run_config = config
    summary = {**model_summary(model), "seed": cfg.seed}  # compare.py pairs runs by seed
    log.info("model: %s", summary)

    loggers = build_loggers(cfg, summary["head_tag"], wandb_id)
    callbacks = build_callbacks(cfg, loggers)
    precision = trainer_precision(cfg.trainer.precision, cfg.trainer.accelerator)
    if precision["float32_matmul_precision"] is not None:
        torch.set_float32_matmul_precision(precision["float32_matmul_precision"])
    trainer: pl.Trainer = instantiate(
        cfg.trainer,
        precision=precision["precision"],
        callbacks=callbacks,
        logger=loggers or False,
        plugins=[*precision["plugins"], AtomicCheckpointIO()],
    )
    # Under DDP each rank decodes its share of the evaluation splits; under FSDP every layer
    # needs every rank, so all ranks decode the whole split, step for step.
    datamodule.shard_eval = not isinstance(trainer.strategy, FSDPStrategy)
    summary["precision"] = trainer.precision  # what runs, from Lightning's precision plugin
    log.info("precision: %s", summary["precision"])
    for logger in trainer.loggers:
        logger.log_hyperparams({**config, **summary})

    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if cfg.get("test"):
            # A fast_dev_run saves no checkpoint: it tests the weights it ends with.
            tested = None if trainer.fast_dev_run else test_checkpoint(trainer, str(cfg.test_ckpt))
            trainer.test(module, datamodule=datamodule, ckpt_path=tested)
            metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
            summary["test/ckpt"] = tested or "final weights"
            summary["test/beam_size"] = module.beam_sizes["test"]
            if trainer.is_global_zero and "test" in module.hypotheses:
                text = "".join(f"{line}\n" for line in module.hypotheses["test"])
                path = Path(run_dir) / "hypotheses.test.txt"
                write_atomically(path, lambda f: f.write(text.encode()))
        if trainer.is_global_zero:
            # Whole-run training throughput and peak memory.
            monitor = next((c for c in trainer.callbacks if isinstance(c, TokenThroughput)), None)
            summary.update(monitor.summary() if monitor else {})
            summary["train/skipped_batches"] = module.skipped_batches
            if cfg.summary.decode_speed and isinstance(trainer.strategy, FSDPStrategy):
                # Each FSDP layer gathers its weights from every rank: rank 0 cannot decode alone.
                log.warning("summary.decode_speed is not measured under FSDP")
            elif cfg.summary.decode_speed:
                device = trainer.strategy.root_device
                forward_context = trainer.precision_plugin.forward_context
                summary.update(decode_summary(module, datamodule, device, cfg, forward_context))
            summary.update(metrics)
            summary |= {"run/start": started, "run/end": utc_now()}
            summary |= {"run/host": host_name(), "run/boot_id": boot_id(), "run/cpu": cpu_model()}
            # What else decides the bits of the weights (docs/usage.md, "Reproducible runs"):
            # the GEMMs' summation order follows the thread count and the kernels' ISA.
            summary["run/threads"] = torch.get_num_threads()
            summary["run/cpu_capability"] = torch.backends.cpu.get_cpu_capability()
            summary["run/wandb_group"] = cfg.get("wandb_group")  # resolved: compare.py reads it
            write_summary(run_dir, summary, trainer)
    finally:
        finish_wandb()
    log.info("run directory: %s", run_dir)
    return summary


def train_language_model(cfg: DictConfig) -> dict[str, Any]:
    """Train a decoder-only LM (``objective=causal_lm``: ``experiment=lm_long``, ``mqar``,
    ``lm_multi30k``) as ``cfg`` says, with the same loggers, callbacks, precision and
    resuming as translation. A Hugging Face model (``lm_multi30k``'s Llama, which
    ``scripts/convert_lm.py`` converts) is also saved with ``save_pretrained`` as ``hf/``.

    Returns the run summary (also ``<run dir>/summary.json`` and wandb's run summary): the
    heads, parameter counts and KV-cache bytes per token, the final held-out figures (loss
    by position bucket, or MQAR accuracy per setting), the data's statistics, and when and
    where the run ran.
    """
    started = utc_now()
    pl.seed_everything(cfg.seed, workers=True)
    run_dir = str(cfg.paths.output_dir)
    check_model_config(OmegaConf.to_container(cfg, resolve=True))  # before the data
    ckpt_path, wandb_id = resume_checkpoint(cfg.get("ckpt_path"), Path(run_dir) / "checkpoints")
    if "wandb" in (cfg.get("logger") or {}):
        configure_wandb_mode(run_dir)
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    datamodule.save_tokenizer(run_dir)
    config = OmegaConf.to_container(cfg, resolve=True)
    model = build_model(config, datamodule.vocab_size, datamodule.pad_id)
    module = instantiate(cfg.module, model=model, tokenizer=datamodule.tokenizer)
    module.run_config = config
    summary = {**model_summary(model), "seed": cfg.seed}
    log.info("model: %s", summary)
    loggers = build_loggers(cfg, summary["head_tag"], wandb_id)
    precision = trainer_precision(cfg.trainer.precision, cfg.trainer.accelerator)
    trainer: pl.Trainer = instantiate(
        cfg.trainer,
        precision=precision["precision"],
        callbacks=build_callbacks(cfg, loggers),
        logger=loggers or False,
        plugins=[*precision["plugins"], AtomicCheckpointIO()],
    )
    summary["precision"] = trainer.precision
    for logger in trainer.loggers:
        logger.log_hyperparams({**config, **summary})
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        # The held-out figures of the weights training ended with (the last validation of
        # fit may be steps before the end); also what a resumed finished run reports.
        final = trainer.validate(module, datamodule=datamodule, verbose=False)
        if trainer.is_global_zero:
            summary.update({k: float(v) for k, v in trainer.callback_metrics.items()})
            summary.update({k: float(v) for k, v in final[0].items()})
            summary["data"] = getattr(datamodule, "stats", None)
            summary["steps"] = trainer.global_step
            summary |= {"run/start": started, "run/end": utc_now()}
            summary |= {"run/host": host_name(), "run/boot_id": boot_id(), "run/cpu": cpu_model()}
            summary["run/threads"] = torch.get_num_threads()
            summary["run/cpu_capability"] = torch.backends.cpu.get_cpu_capability()
            summary["run/wandb_group"] = cfg.get("wandb_group")
            write_summary(run_dir, summary, trainer)
            if hasattr(model, "save_pretrained"):  # a Hugging Face model: its own format too
                model.save_pretrained(Path(run_dir) / "hf")
    finally:
        finish_wandb()
    log.info("run directory: %s", run_dir)
    return summary


def write_summary(run_dir: str, summary: dict[str, Any], trainer: pl.Trainer) -> None:
    """``summary.json`` in the run directory, and the same figures in wandb's run summary."""
    text = json.dumps(summary, indent=2, sort_keys=True) + "\n"
    write_atomically(Path(run_dir) / "summary.json", lambda f: f.write(text.encode()))
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            logger.experiment.summary.update(summary)
    log.info("summary: %s", json.dumps(summary, sort_keys=True))
