"""Reuse the layer in someone else's model: swap the attention of an ``nn.TransformerEncoder``
for MultiHeadAttention, convert it to GQA, and uptrain.

    python docs/examples/uptrain_gqa.py

Torch only. A small encoder learns to reverse sequences of random tokens with torch's own
attention; ``replace_torch_attention`` swaps it (the loss does not move), ``with_kv_heads``
mean-pools its 4 K/V heads into ``--kv-heads`` (the loss rises), and a sixth of the first
training brings the loss back down, far below the same GQA model trained from scratch as long.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead import replace_torch_attention
from multihead.attention import TorchAttentionAdapter, with_kv_heads

VOCAB, LENGTH, DIM, HEADS, BATCH = 16, 12, 64, 4, 32


class Reverser(nn.Module):
    """Tokens and positions in, ``nn.TransformerEncoder``, a logit per token out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, DIM), nn.Parameter(torch.randn(LENGTH, DIM))
        layer = nn.TransformerEncoderLayer(DIM, HEADS, 4 * DIM, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.encoder(self.embed(tokens) + self.pos))  # (B, LENGTH, VOCAB)


def batch(size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(VOCAB, (size, LENGTH), generator=generator)
    return tokens, tokens.flip(1)


def loss_on(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))


def train(model: nn.Module, steps: int, lr: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=steps)
    model.train()
    for _ in range(steps):
        loss = loss_on(model, *batch(BATCH, generator))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training with torch's attention")
    parser.add_argument("--uptrain-steps", type=int, default=50)
    parser.add_argument("--kv-heads", type=int, default=1)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = Reverser()
    held_out = batch(512, torch.Generator().manual_seed(1234))

    def evaluate(name: str) -> float:
        with torch.no_grad():
            loss = loss_on(model.eval(), *held_out).item()
        print(f"{name:<42} held-out loss {loss:.4f}")
        return loss

    losses = {}
    losses["mha_untrained"] = evaluate("torch attention, untrained")
    train(model, args.steps, lr=3e-3, seed=1)
    losses["mha"] = evaluate(f"torch attention, {args.steps} steps")
    replace_torch_attention(model)
    losses["swapped"] = evaluate("swapped for MultiHeadAttention")
    for module in model.modules():
        if isinstance(module, TorchAttentionAdapter):
            module.attn = with_kv_heads(module.attn, args.kv_heads)
    losses["converted"] = evaluate(f"converted to {args.kv_heads} K/V heads")
    train(model, args.uptrain_steps, lr=1e-3, seed=2)
    losses["uptrained"] = evaluate(f"uptrained {args.uptrain_steps} steps")

    # The control: the same GQA model from scratch, trained as long as the uptraining.
    torch.manual_seed(0)
    model = replace_torch_attention(Reverser())
    for module in model.modules():
        if isinstance(module, TorchAttentionAdapter):
            module.attn = with_kv_heads(module.attn, args.kv_heads)
    train(model, args.uptrain_steps, lr=3e-3, seed=1)
    losses["scratch"] = evaluate(f"from scratch, {args.uptrain_steps} steps")
    return losses


if __name__ == "__main__":
    main()
