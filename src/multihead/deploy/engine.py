"""Translate with an exported CTranslate2 model under the rules of our own decoder.

:func:`multihead.model.greedy_decode` and :func:`~multihead.model.beam_search` differ from
CTranslate2's defaults in four ways; :class:`CTranslate2Engine` maps each one:

- Length limit: ours is per sentence, ``min(floor(a * src_len + b), max_positions - 1)``
  tokens then eos (``src_len`` counts the source's eos). CTranslate2 takes one
  ``max_decoding_length`` per batch, counting the eos step, so the engine passes the batch's
  largest limit plus one. Greedy outputs are then cut to each sentence's own limit, which is
  exactly ours (greedy is decided token by token). Beam search cannot be cut so: a sentence
  whose live beams reach its own limit before ``K`` hypotheses finished is ended there by
  ours (eos forced) but searched further by CTranslate2, so such sentences may differ. At
  the batch limit itself CTranslate2 ends live beams without scoring an eos.
- ``min_decoding_length=0``: ours may emit eos as the first token (CTranslate2's default
  forbids it).
- Length penalty: ours divides by the length counting eos; ``return_end_token=True`` makes
  CTranslate2 count it too (the eos is stripped from the output).
- Tokens: CTranslate2 works on token strings. Our byte-level BPE maps every string to tokens
  whose strings are unique (export checks it) and contain no whitespace, and the export's
  vocabulary lists them in id order, so string in, string out is the same as ids. The
  source gets eos from the model config (``add_source_eos``), as our ``collate`` adds it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from multihead.data import Tokenizer, batches_by_length
from multihead.deploy.export import SETTINGS_FILE, TOKENIZER_FILE, import_ctranslate2

COMPUTE_TYPES = ("default", "float32", "int8", "int8_float32", "int16")


class CTranslate2Engine:
    """An exported model directory, loaded for CPU translation.

    Args:
        model_dir: written by ``scripts/export.py format=ctranslate2``.
        compute_type: ``"default"`` keeps the exported float32 weights; ``"int8"``
            quantizes them when loading.
        threads: CTranslate2's ``intra_threads`` (0 lets it choose).
    """

    def __init__(self, model_dir: str | Path, *, compute_type: str = "default", threads: int = 0):
        ctranslate2 = import_ctranslate2()
        model_dir = Path(model_dir)
        if compute_type not in COMPUTE_TYPES:
            raise ValueError(
                f"unknown compute_type {compute_type!r}; expected one of {', '.join(COMPUTE_TYPES)}"
            )
        if threads < 0:
            raise ValueError(f"threads must be >= 0, got {threads}")
        settings_path = model_dir / SETTINGS_FILE
        if not settings_path.is_file() or not (model_dir / "model.bin").is_file():
            raise FileNotFoundError(
                f"model={model_dir} is not an exported CTranslate2 model: expected model.bin "
                f"and {SETTINGS_FILE} (written by scripts/export.py format=ctranslate2)"
            )
        self.settings = json.loads(settings_path.read_text(encoding="utf-8"))
        self.tokenizer = Tokenizer.load(model_dir / TOKENIZER_FILE)
        # Making a Translator sets the process's OpenMP thread count (torch's too) to its own
        # choice; torch's is put back, so loading an engine does not change how, or how
        # reproducibly (reduction order), torch computes in the same process afterwards.
        torch_threads = torch.get_num_threads()
        self.translator = ctranslate2.Translator(
            str(model_dir), device="cpu", compute_type=compute_type, intra_threads=threads
        )
        torch.set_num_threads(torch_threads)
        # The exported vocabulary lists the token string of every id, in id order.
        vocabulary_path = model_dir / "shared_vocabulary.json"
        self.vocabulary = json.loads(vocabulary_path.read_text(encoding="utf-8"))
        self._ids = {token: i for i, token in enumerate(self.vocabulary)}

    def max_output_length(self, num_src_ids: int, *, max_len_a: float, max_len_b: float) -> int:
        """Our per-sentence limit for a source of ``num_src_ids`` subwords (eos added)."""
        limit = math.floor((num_src_ids + 1) * max_len_a + max_len_b)
        return max(0, min(limit, self.settings["max_positions"] - 1))

    def translate(
        self,
        sentences: list[str],
        *,
        beam_size: int,
        length_penalty: float,
        max_len_a: float,
        max_len_b: float,
        batch_size: int = 128,
    ) -> list[str]:
        """Translate ``sentences`` in batches sorted by length, outputs in input order.

        The arguments mean what they mean for :func:`multihead.evaluation.translate`; the
        exported model's trained settings are ``search_settings(self.settings)``.
        """
        if beam_size < 1 or batch_size < 1:
            raise ValueError(
                f"beam_size and batch_size must be >= 1, got {beam_size}, {batch_size}"
            )
        tokens = [
            [self.vocabulary[i] for i in ids] for ids in self.tokenizer.encode_batch(sentences)
        ]
        out = [""] * len(tokens)
        for chunk in batches_by_length([len(t) for t in tokens], batch_size):  # as ours
            limits = [
                self.max_output_length(len(tokens[i]), max_len_a=max_len_a, max_len_b=max_len_b)
                for i in chunk
            ]
            results = self.translator.translate_batch(
                [tokens[i] for i in chunk],
                beam_size=beam_size,
                length_penalty=length_penalty,
                max_decoding_length=max(limits) + 1,  # + the step that can only be eos
                min_decoding_length=0,
                max_input_length=0,
                return_end_token=True,
            )
            # Ids cut at each sentence's limit; decode_batch cuts them at eos, as ours.
            hyp_ids = [
                [self._ids[t] for t in result.hypotheses[0]][:limit]
                for result, limit in zip(results, limits, strict=True)
            ]
            for i, text in zip(chunk, self.tokenizer.decode_batch(hyp_ids), strict=True):
                out[i] = text
        return out
