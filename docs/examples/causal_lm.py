"""A decoder-only language model built from MultiHeadAttention with GQA, trained on the
English side of Multi30k one byte at a time, then sampled with the KV cache.

    python docs/examples/causal_lm.py --data ../shared/data/multi30k   # or $MULTIHEAD_DATA_DIR

Torch only (``pip install multihead``). It trains for ``--steps`` steps, checks that the
validation loss is below ``--bound`` nats per byte, and checks that sampling with the KV cache
picks the same bytes, one by one, as sampling with the whole prefix recomputed at every step.
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead import KVCache, MultiHeadAttention

VOCAB = 256  # bytes


class Block(nn.Module):
    """Pre-norm: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = MultiHeadAttention(dim, heads, kv_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor, cache: KVCache | None) -> Tensor:
        x = x + self.attn(self.norm1(x), is_causal=True, kv_cache=cache)
        return x + self.mlp(self.norm2(x))


class CausalLM(nn.Module):
    def __init__(self, dim=64, heads=4, kv_heads=2, layers=2, max_len=128) -> None:
        super().__init__()
        self.max_len = max_len
        self.embed, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB, bias=False)

    def forward(self, ids: Tensor, caches: list[KVCache] | None = None) -> Tensor:
        """``ids`` (B, T) -> logits (B, T, VOCAB). With caches, ``ids`` follow what they hold."""
        start = 0 if caches is None else caches[0].size
        x = self.embed(ids) + self.pos(torch.arange(start, start + ids.shape[1]))
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        return self.head(self.norm(x))

    def make_caches(self, batch_size: int) -> list[KVCache]:
        return [block.attn.make_kv_cache(batch_size, self.max_len) for block in self.blocks]


def read_bytes(path: Path) -> Tensor:
    with gzip.open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()


def windows(data: Tensor, starts: Tensor, length: int) -> Tensor:
    return data[starts[:, None] + torch.arange(length + 1)]  # (B, length + 1)


def bigram_loss(train: Tensor, val: Tensor) -> float:
    """Cross-entropy on ``val`` of byte-pair counts from ``train`` (add-0.01 smoothing)."""
    counts = torch.full((VOCAB, VOCAB), 0.01, dtype=torch.float64)
    counts.index_put_((train[:-1], train[1:]), torch.ones(len(train) - 1).double(), True)
    log_p = (counts / counts.sum(dim=1, keepdim=True)).log()
    return -log_p[val[:-1], val[1:]].mean().item()


def loss_on(model: CausalLM, batch: Tensor) -> Tensor:
    logits = model(batch[:, :-1])  # (B, T, VOCAB)
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


@torch.no_grad()
def sample(model: CausalLM, prompt: Tensor, n: int, noise: Tensor, cached: bool) -> list[int]:
    """``n`` bytes after ``prompt`` (1, P), drawn from softmax(logits / 0.8) as the argmax
    of ``logits / 0.8 + noise[t]`` with Gumbel ``noise`` (n, VOCAB): both ways get the same."""
    ids, out = prompt, []
    caches = model.make_caches(1) if cached else None
    for t in range(n):
        logits = model(ids[:, -1:] if cached and t > 0 else ids, caches)[0, -1]
        out.append(int((logits / 0.8 + noise[t]).argmax()))
        ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.environ.get("MULTIHEAD_DATA_DIR"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--bound", type=float, default=2.0, help="nats per byte")
    args = parser.parse_args(argv)
    if args.data is None or not (Path(args.data) / "train.en.gz").is_file():
        parser.error(f"--data must be a directory with train.en.gz, got {args.data}")

    torch.manual_seed(0)
    train, val = (read_bytes(Path(args.data) / f"{s}.en.gz") for s in ("train", "val"))
    model = CausalLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 2e-2, total_steps=args.steps)
    context, batch_size = 64, 16
    for step in range(1, args.steps + 1):
        starts = torch.randint(len(train) - context - 1, (batch_size,))
        loss = loss_on(model, windows(train, starts, context))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0:
            print(f"step {step}: train loss {loss.item():.3f}")
    model.eval()
    with torch.no_grad():  # the same 64 windows of the validation text every run
        starts = torch.linspace(0, len(val) - context - 2, 64).long()
        val_loss = loss_on(model, windows(val, starts, context)).item()
    print(
        f"validation loss {val_loss:.3f} nats/byte (bound {args.bound}; byte-pair counts: "
        f"{bigram_loss(train, val):.3f})"
    )

    prompt = torch.tensor([list(b"A man ")])
    noise = -torch.log(-torch.log(torch.rand(100, VOCAB)))  # Gumbel(0, 1)
    cached = sample(model, prompt, 100, noise, cached=True)
    full = sample(model, prompt, 100, noise, cached=False)
    print(repr(bytes(list(b"A man ") + cached).decode("utf-8", errors="replace")))
    same = cached == full
    print(f"KV-cache sampling equals the full pass: {same} ({len(cached)} bytes)")
    if val_loss >= args.bound or not same:
        sys.exit(1)
    return {"val_loss": val_loss, "cached": cached, "full": full}


if __name__ == "__main__":
    main()
