"""Head designs written outside the package, as a researcher would, for the tests that
train, evaluate and decode them by import path (torch and the core alone)."""

from __future__ import annotations

from pathlib import Path

# Sigmoid attention (Ramapuram et al., 2024): sigmoid(Q K^T / sqrt(D) - log n) in place of
# the softmax, through the math kernel's hooks; its option n is the number of keys
# ("length") or a number. With n the key length its formula needs every key of the
# sequence, which a cached decoding step does not see: it says so (refuses_kv_cache), and
# decoding recomputes the full prefix. With a number it is exact under the cache.
SIGMOID = """
import math

import torch

from multihead.attention import HeadDesign


class Sigmoid(HeadDesign):
    name, attribute = "sigmoid", "sigmoid"

    def __init__(self, embed_dim, num_heads, num_kv_heads, *, bias, device=None, dtype=None,
                 sigmoid_n="length"):
        super().__init__()
        if sigmoid_n != "length" and not float(sigmoid_n) > 0:
            raise ValueError(f"sigmoid_n must be 'length' or a positive number, got {sigmoid_n!r}")
        self.sigmoid_n = sigmoid_n
        self.refuses_kv_cache = sigmoid_n == "length"  # a cached step sees fewer keys

    @property
    def options(self):
        return {"sigmoid_n": self.sigmoid_n}

    # The math kernel's hooks (so the layer runs on backend math only, refused elsewhere).
    def on_logits(self, scores):  # (B, H, L, S), before the mask
        n = scores.shape[-1] if self.sigmoid_n == "length" else float(self.sigmoid_n)
        return scores - math.log(n)

    def on_weights(self, weights, scores, mask):  # scores: masked, -inf gives no weight
        return torch.sigmoid(scores)
"""


def write_sigmoid(directory: Path) -> Path:
    """``sigmoid_attention.py`` (the design ``sigmoid_attention.Sigmoid``) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sigmoid_attention.py").write_text(SIGMOID)
    return directory
