"""Small checkpoints for the export tests: a BPE trained on made-up sentences and a random
Transformer whose outputs end at varied lengths, saved as ``scripts/train.py`` saves them."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from multihead.checkpoints import FORMAT_VERSION
from multihead.data import Tokenizer, collate
from multihead.model import Transformer
from multihead.model.transformer import ATTENTION_SUBLAYERS

# A toy language pair: each English word has one German word.
_EN = "a man woman dog child runs sits on the in with red blue ball street park beach"
_DE = "ein mann frau hund kind läuft sitzt auf dem im mit roten blauen ball straße park strand"
LEXICON = dict(zip(_EN.split(), _DE.split(), strict=True))


def pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` made-up sentence pairs of 2 to 12 words, translated word by word."""
    rng = random.Random(seed)
    words = sorted(LEXICON)
    out = []
    for _ in range(n):
        en = [rng.choice(words) for _ in range(rng.randint(2, 12))]
        de = [LEXICON[w] for w in en]
        out.append((" ".join(en).capitalize() + ".", " ".join(de).capitalize() + "."))
    return out


def sentences(n: int, seed: int = 0) -> list[str]:
    """The English side of :func:`pairs`."""
    return [en for en, _ in pairs(n, seed)]


def tokenizer(lowercase: bool = False) -> Tokenizer:
    return Tokenizer.train(
        [s for p in pairs(400, seed=1) for s in p], vocab_size=320, lowercase=lowercase
    )


def train(model: Transformer, tok: Tokenizer, steps: int, seed: int = 0) -> None:
    """Teacher-forced Adam steps on :func:`pairs`, enough for outputs that end with eos."""
    data = pairs(2000, seed=seed + 100)
    rng = random.Random(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = rng.sample(data, 32)
        examples = [
            {"src_ids": tok.encode(en), "tgt_ids": tok.encode(de), "src": en, "tgt": de, "index": 0}
            for en, de in batch
        ]
        b = collate(examples, pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id)
        logits = model(b["src"], b["tgt"][:, :-1])
        loss = F.cross_entropy(
            logits.flatten(0, 1), b["tgt"][:, 1:].flatten(), ignore_index=tok.pad_id
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def save_checkpoint(
    path: Path, tok: Tokenizer, *, seed: int = 0, steps: int = 0, **model: Any
) -> Transformer:
    """Save a model (trained ``steps`` steps) in the checkpoint format and return it.

    Norm weights and biases are perturbed so that none is left at its trivial value.
    """
    torch.manual_seed(seed)
    config: dict[str, Any] = dict(
        d_model=32,
        ffn_dim=64,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dropout=0.0,
        max_positions=128,
        share_embeddings=False,
        tie_output=False,
        attention={"num_heads": 4, "num_kv_heads": None, "backend": "sdpa"},
    )
    config.update(model)
    net = Transformer(
        src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, pad_id=tok.pad_id, **config
    ).eval()
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    train(net, tok, steps, seed)
    # The run config as train.py stores it: heads in their own section, the model's sizes.
    attention = dict(config.pop("attention"))
    for kind in ATTENTION_SUBLAYERS:
        attention[kind] = config.pop(kind, None)
    ckpt = {
        "state_dict": {f"model.{k}": v for k, v in net.state_dict().items()},
        "multihead": {
            "format_version": FORMAT_VERSION,
            "config": {
                "model": {"_target_": "multihead.model.Transformer", **config},
                "attention": attention,
                "data": {"src_lang": "en", "tgt_lang": "de"},
                "module": {"length_penalty": 1.0, "max_len_a": 1.2, "max_len_b": 10},
            },
            "tokenizer": tok.to_str(),
        },
    }
    torch.save(ckpt, path)
    return net
