"""Speeds of trained runs measured side by side: one process, configurations interleaved.

A run's own speeds (``perf/...`` and ``decode/...`` in its ``summary.json``) were measured
while it trained, on whatever else the machine was doing then; runs of a sweep that shared
a host slowed each other. ``scripts/compare.py speed=true`` measures every run again here,
in one process, round by round (each round times every run once), so that noise hits them
alike, with the timer of ``scripts/benchmark_training.py --attention`` and
``scripts/benchmark_decoding.py`` (:mod:`multihead.timing`):

- training: forward, backward, gradient clipping and the run's own optimizer step, on the
  same training sentences for every run (each tokenized by the run's own tokenizer), in
  fp32; real target tokens per second.
- decoding: greedy and beam search with the KV cache on the test split, with the run's
  trained checkpoint and its own length limits, so the outputs (and their lengths) are the
  run's; sentences per second.

Each figure is the median over the rounds, after one untimed warm-up round.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate

from multihead.checkpoints import load_trained_model, search_settings
from multihead.data import load_parallel_dataset
from multihead.data.batching import collate, pack_batches
from multihead.evaluation import translate
from multihead.host import cpu_model, host_name
from multihead.timing import interleaved_medians

# The summary keys of the side-by-side figures (compare.py's columns and plots).
TRAIN_KEY = "speed/train_tgt_tokens_per_s"
GREEDY_KEY = "speed/greedy_sentences_per_s"
BEAM_KEY = "speed/beam_sentences_per_s"


def training_batches(trained, pairs: list[tuple[str, str]], max_tokens: int) -> list[dict]:
    """``pairs`` tokenized by the run's tokenizer, packed into batches of ``max_tokens``
    in their order (the same sentences for every run)."""
    tok = trained.tokenizer
    src_ids = tok.encode_batch([s for s, _ in pairs])
    tgt_ids = tok.encode_batch([t for _, t in pairs])
    examples = [
        {"src_ids": s, "tgt_ids": t, "src": src, "tgt": tgt}
        for s, t, (src, tgt) in zip(src_ids, tgt_ids, pairs, strict=True)
    ]
    lengths = [max(len(e["src_ids"]) + 1, len(e["tgt_ids"]) + 2) for e in examples]
    batches = pack_batches(range(len(examples)), lengths, max_tokens)
    pad, bos, eos = tok.pad_id, tok.bos_id, tok.eos_id
    return [collate([examples[i] for i in b], pad_id=pad, bos_id=bos, eos_id=eos) for b in batches]


def training_step_job(trained, batches: list[dict]) -> tuple[Callable[[], None], int]:
    """A job that trains the run's model (a copy) for one pass over ``batches`` with its
    own module config (loss, label smoothing) and optimizer, and the real target tokens of
    that pass."""
    import copy

    model = copy.deepcopy(trained.model).train()
    module = instantiate(trained.config["module"], model=model, tokenizer=trained.tokenizer)
    # Not configure_optimizers(): its scheduler may need a Trainer (cooldown_minutes).
    optimizer = module.optimizer_factory(module.parameters())
    pad = trained.tokenizer.pad_id
    targets = sum(int((b["tgt"][:, 1:] != pad).sum()) for b in batches)

    def job() -> None:
        for batch in batches:
            loss, _ = module.loss(batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return job, targets


def measure(
    checkpoints: dict[str, str | Path],
    *,
    rounds: int = 3,
    limit: int | None = None,
    beam_size: int = 5,
    batch_size: int = 128,
    train_sentences: int = 512,
    max_tokens: int = 4096,
    threads: int | None = None,
    local_dir: str | None = None,
) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """Side-by-side speeds of each run's checkpoint (by run label).

    Returns ``({label: {TRAIN_KEY: ..., GREEDY_KEY: ..., BEAM_KEY: ...}}, setup)``, where
    ``setup`` says where and how they were measured (host, CPU, threads, sentences, ...).
    Test and training sentences come from the first checkpoint's data settings;
    ``local_dir`` overrides where the raw corpus is read from.
    """
    if rounds < 1:
        raise ValueError(f"speed_options.rounds={rounds}; expected >= 1")
    if threads is not None:
        torch.set_num_threads(threads)
    trained = {label: load_trained_model(path) for label, path in checkpoints.items()}
    data = next(iter(trained.values())).config["data"]
    splits = load_parallel_dataset(
        name=data["name"],
        src_lang=data["src_lang"],
        tgt_lang=data["tgt_lang"],
        local_dir=local_dir if local_dir is not None else data.get("local_dir"),
    )
    sources = list(splits["test"]["src"])[:limit]
    train = splits["train"].select(range(min(train_sentences, len(splits["train"]))))
    pairs = list(zip(train["src"], train["tgt"], strict=True))

    jobs, targets = {}, {}
    for label, t in trained.items():
        t.model.eval()
        settings = search_settings(t.config)
        for name, beam in (("greedy", 1), ("beam", beam_size)):

            def decode(t=t, beam=beam, settings=settings) -> None:
                with torch.inference_mode():
                    translate(
                        t.model,
                        t.tokenizer,
                        sources,
                        beam_size=beam,
                        batch_size=batch_size,
                        **settings,
                    )

            jobs[label, name] = decode
        jobs[label, "train"], targets[label] = training_step_job(
            t, training_batches(t, pairs, max_tokens)
        )
    seconds = interleaved_medians(jobs, rounds)
    speeds = {
        label: {
            TRAIN_KEY: targets[label] / seconds[label, "train"],
            GREEDY_KEY: len(sources) / seconds[label, "greedy"],
            BEAM_KEY: len(sources) / seconds[label, "beam"],
        }
        for label in trained
    }
    setup = {
        "host": host_name(),
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "test_sentences": len(sources),
        "train_sentences": len(pairs),
        "max_tokens": max_tokens,
        "beam_size": beam_size,
        "batch_size": batch_size,
        "rounds": rounds,
    }
    return speeds, setup
