"""Scoring a checkpoint on a data split (scripts/evaluate.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from multihead.checkpoints import load_trained_model, search_settings, write_atomically
from multihead.data import load_parallel_dataset
from multihead.data.loading import SPLITS
from multihead.evaluation.metrics import corpus_scores, tokenized_bleu
from multihead.evaluation.translate import translate


def evaluate_checkpoint(
    ckpt: str,
    out_dir: str | Path,
    *,
    split: str = "test",
    beam_size: int = 5,
    length_penalty: float | None = None,
    max_len_a: float | None = None,
    max_len_b: float | None = None,
    batch_size: int = 128,
    limit: int | None = None,
    backend: str | None = None,
    local_dir: str | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Translate ``split`` with the checkpoint, score it, write hypotheses and scores.

    Writes ``hypotheses.<split>.txt`` (one line per source sentence, in order) and
    ``scores.json`` into ``out_dir``. Returns the scores. Search settings left ``None`` are
    the ones the checkpoint was trained with.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; expected one of {', '.join(SPLITS)}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit}; expected a positive number of sentences or null")
    trained = load_trained_model(ckpt, backend=backend)
    data_cfg = trained.config["data"]
    dataset = load_parallel_dataset(
        name=data_cfg["name"],
        src_lang=data_cfg["src_lang"],
        tgt_lang=data_cfg["tgt_lang"],
        local_dir=local_dir if local_dir is not None else data_cfg.get("local_dir"),
    )[split]
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    sources, references = list(dataset["src"]), list(dataset["tgt"])

    model = trained.model.to(device)
    start = time.perf_counter()
    with torch.inference_mode():
        hypotheses = translate(
            model,
            trained.tokenizer,
            sources,
            beam_size=beam_size,
            batch_size=batch_size,
            **search_settings(
                trained.config,
                length_penalty=length_penalty,
                max_len_a=max_len_a,
                max_len_b=max_len_b,
            ),
        )
    seconds = time.perf_counter() - start

    scores = corpus_scores(hypotheses, references)
    result = {
        "checkpoint": str(ckpt),
        "split": split,
        "sentences": len(sources),
        "beam_size": beam_size,
        "bleu": scores.bleu,
        "bleu_signature": scores.bleu_signature,
        "chrf": scores.chrf,
        "chrf_signature": scores.chrf_signature,
        "bleu_lc_tok": tokenized_bleu(hypotheses, references, data_cfg["tgt_lang"]),
        "sentences_per_s": len(sources) / seconds,
    }
    out_dir = Path(out_dir)  # write_atomically creates it
    for name, text in (
        (f"hypotheses.{split}.txt", "\n".join(hypotheses) + "\n"),
        ("scores.json", json.dumps(result, indent=2) + "\n"),
    ):
        write_atomically(out_dir / name, lambda f, text=text: f.write(text.encode()))
    return result
