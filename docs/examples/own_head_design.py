"""A head design written outside the package: a learned temperature per head.

Each head divides its scores by its own temperature ``t_h`` (started at 1, so a new layer is
plain attention) before the softmax: ``softmax(Q_h K_h^T / (sqrt(D) t_h))``. It is one class
and one ``register_design`` call; the layer, the Transformer (``decoder_self_attention`` and
any other sublayer's options) and the KV cache take it by name, and nothing in ``multihead``
changes.

    python docs/examples/own_head_design.py

``scripts/train.py`` takes it by its import path, with its option from the command line, and
the checkpoint records the path, so ``scripts/evaluate.py`` builds it again (the directory on
``PYTHONPATH`` for both; tests/scripts/test_train_script.py does this with a design of its own):

    PYTHONPATH=docs/examples python scripts/train.py experiment=smoke \
        data.local_dir=../shared/data/multi30k attention.design=own_head_design.HeadTemperature \
        ++attention.design_options.start=2.0 hydra.run.dir=outputs/head_temperature
    PYTHONPATH=docs/examples python scripts/evaluate.py \
        ckpt=outputs/head_temperature/checkpoints/last.ckpt
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from multihead import MultiHeadAttention
from multihead.attention import HeadDesign, register_design
from multihead.attention.designs import weights_times_values
from multihead.model import Transformer


class HeadTemperature(HeadDesign):
    """A learned temperature per query head, applied by scaling each head's queries."""

    name = "head_temperature"
    attribute = "head_temp"  # its state_dict prefix: head_temp.log_temperature

    def __init__(
        self, embed_dim: int, num_heads: int, num_kv_heads: int, *, bias: bool,
        device=None, dtype=None, start: float = 1.0,
    ) -> None:  # fmt: skip
        super().__init__()
        if start <= 0:
            raise ValueError(f"start must be a positive temperature, got {start}")
        # log t, so that t stays positive whatever the optimizer does: (H, 1, 1)
        log_t = torch.full((num_heads, 1, 1), float(start), device=device, dtype=dtype).log()
        self.log_temperature = nn.Parameter(log_t)
        self.start = start

    @property
    def options(self) -> dict[str, object]:
        return {"start": self.start}  # what builds it again; the layer adds its name

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask, call):
        # Scaling Q_h by 1 / t_h scales head h's scores by it, on any backend: the kernel
        # (the layer's, call.attend) keeps its own 1 / sqrt(D). q: (B, H, L, D)
        return call.attend(q / self.log_temperature.exp(), k, v, mask)

    def head_outputs(self, layer, weights: Tensor, source: Tensor) -> Tensor:
        # The kernel's weights are the final ones, those that multiply V: head analysis may
        # rebuild each head's output from them (a design with its own attend must say so).
        return weights_times_values(layer, weights, source)


register_design(HeadTemperature.name, HeadTemperature)


def main() -> dict[str, float]:
    torch.manual_seed(0)
    # The layer, by name, with the design's own option.
    attn = MultiHeadAttention(64, 8, num_kv_heads=2, design="head_temperature", start=0.5).eval()
    x = torch.randn(2, 7, 64)
    full = attn(x, is_causal=True)  # (B, L, E)
    cache = attn.make_kv_cache(batch_size=2, max_len=7)
    steps = [attn(x[:, i : i + 1], is_causal=True, kv_cache=cache) for i in range(7)]
    layer_diff = (torch.cat(steps, dim=1) - full).abs().max().item()

    # The Transformer, by name in a sublayer's options.
    model = Transformer(
        src_vocab_size=50, tgt_vocab_size=50, d_model=32, ffn_dim=64, num_encoder_layers=2,
        num_decoder_layers=2, dropout=0.0, max_positions=64, attention={"num_heads": 4},
        decoder_self_attention={"design": "head_temperature", "design_options": {"start": 2.0}},
    ).eval()  # fmt: skip
    src, tgt = torch.randint(4, 50, (2, 6)), torch.randint(4, 50, (2, 5))
    logits = model(src, tgt)  # (B, T, V), the full pass
    memory, src_pad = model.encode(src)
    caches = model.make_decoder_cache(2, max_tgt_len=5, src_len=6)
    cached = [model.decode(tgt[:, i : i + 1], memory, src_pad, caches) for i in range(5)]
    model_diff = (torch.cat(cached, dim=1) - logits).abs().max().item()
    tags = model.head_config["decoder_self_attention"]
    print(f"layer {attn.head_tag}: cached decoding - full pass, max |diff| {layer_diff:.1e}")
    print(f"Transformer decoder {tags}: cached - full, max |diff| {model_diff:.1e}")
    if max(layer_diff, model_diff) > 1e-5:
        raise SystemExit("cached decoding differs from the full pass")
    return {"layer": layer_diff, "model": model_diff}


if __name__ == "__main__":
    main()
