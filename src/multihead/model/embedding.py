"""Token and positional embeddings of the Transformer ("Attention Is All You Need", 3.4-3.5).

The input to each stack is ``dropout(sqrt(E) * token_embedding + positional)``. The token
embedding is initialised as in fairseq, ``normal(0, E^-0.5)`` with the padding row zero, so
after the ``sqrt(E)`` scaling the token part has unit variance, the same scale as the
sinusoids it is added to.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from multihead.model.dropout import Dropout


def make_token_embedding(vocab_size: int, embed_dim: int, pad_id: int) -> nn.Embedding:
    """An ``nn.Embedding`` initialised ``normal(0, E^-0.5)`` with row ``pad_id`` zero.

    ``padding_idx`` keeps the padding row out of the lookup's gradient. When the matrix is
    also the (tied) output projection that projection's gradient still reaches the row, as in
    fairseq; it only matters for the score of predicting padding, which the loss ignores.
    """
    if not 0 <= pad_id < vocab_size:
        raise ValueError(f"pad_id must be in [0, vocab_size={vocab_size}), got {pad_id}")
    embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=pad_id)
    nn.init.normal_(embedding.weight, mean=0.0, std=embed_dim**-0.5)
    with torch.no_grad():
        embedding.weight[pad_id].zero_()
    return embedding


def _check_positions(start_pos: int, seq_len: int, max_positions: int) -> None:
    if start_pos < 0 or start_pos + seq_len > max_positions:
        raise ValueError(
            f"positions [{start_pos}, {start_pos + seq_len}) do not fit in "
            f"max_positions={max_positions}"
        )


class SinusoidalPositionalEncoding(nn.Module):
    """The fixed encoding of Vaswani et al. (2017), section 3.5::

        PE(pos, 2i)     = sin(pos / 10000^(2i / E))
        PE(pos, 2i + 1) = cos(pos / 10000^(2i / E))

    Positions start at 0. The table is a non-persistent buffer: it is rebuilt from the
    formula, not stored in checkpoints.

    Args:
        embed_dim: ``E``.
        max_positions: the number of rows in the table.
    """

    def __init__(self, embed_dim: int, max_positions: int) -> None:
        super().__init__()
        self.max_positions = max_positions
        position = torch.arange(max_positions, dtype=torch.float32)[:, None]  # (P, 1)
        inv_freq = torch.exp(
            torch.arange(0, embed_dim, 2, dtype=torch.float32) * (-math.log(10000.0) / embed_dim)
        )  # (ceil(E/2),)
        table = torch.zeros(max_positions, embed_dim)
        table[:, 0::2] = torch.sin(position * inv_freq)
        # With an odd E the last sine has no cosine partner.
        table[:, 1::2] = torch.cos(position * inv_freq[: embed_dim // 2])
        self.register_buffer("table", table, persistent=False)

    def forward(self, seq_len: int, start_pos: int = 0) -> Tensor:
        """The encodings of positions ``start_pos .. start_pos + seq_len - 1``, ``(L, E)``."""
        _check_positions(start_pos, seq_len, self.max_positions)
        return self.table[start_pos : start_pos + seq_len]


class LearnedPositionalEmbedding(nn.Module):
    """One trained vector per position, initialised ``normal(0, E^-0.5)`` (fairseq).

    Args:
        embed_dim: ``E``.
        max_positions: the number of positions that can be embedded.
    """

    def __init__(self, embed_dim: int, max_positions: int) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.weight = nn.Parameter(torch.randn(max_positions, embed_dim) * embed_dim**-0.5)

    def forward(self, seq_len: int, start_pos: int = 0) -> Tensor:
        """The embeddings of positions ``start_pos .. start_pos + seq_len - 1``, ``(L, E)``."""
        _check_positions(start_pos, seq_len, self.max_positions)
        return self.weight[start_pos : start_pos + seq_len]


POSITIONAL = {"sinusoidal": SinusoidalPositionalEncoding, "learned": LearnedPositionalEmbedding}
# Rotary positions and ALiBi live in the self-attention layers, not in the embedding.
POSITIONS = (*POSITIONAL, "rope", "alibi")


class TransformerEmbedding(nn.Module):
    """``dropout(sqrt(E) * token(ids) + positional(positions))``.

    Args:
        token: the token embedding, possibly shared with another stack and with the output
            projection (see :func:`make_token_embedding`).
        positional: ``"sinusoidal"``, ``"learned"``, or ``"rope"`` and ``"alibi"``: no
            positions added here, the self-attention layers rotate Q and K or bias the scores.
        max_positions: the longest sequence (including positions reached while decoding).
        dropout: applied to the sum.

    Shapes:
        tokens ``(B, L)`` long; output ``(B, L, E)``.
    """

    def __init__(
        self, token: nn.Embedding, *, positional: str, max_positions: int, dropout: float
    ) -> None:
        super().__init__()
        if positional not in POSITIONS:
            raise ValueError(
                f"unknown positional {positional!r}; expected one of {', '.join(POSITIONS)}"
            )
        self.token = token
        self.embed_dim = token.embedding_dim
        self.scale = math.sqrt(self.embed_dim)
        self.max_positions = max_positions
        self.positional = (
            POSITIONAL[positional](self.embed_dim, max_positions)
            if positional in POSITIONAL
            else None
        )
        self.dropout = Dropout(dropout)

    def forward(self, tokens: Tensor, start_pos: int = 0) -> Tensor:
        """Embed ``tokens`` ``(B, L)`` placed at positions ``start_pos ..`` (for decoding)."""
        x = self.token(tokens) * self.scale  # (B, L, E)
        if self.positional is None:  # rope, alibi: the attention layers place the tokens
            _check_positions(start_pos, tokens.shape[1], self.max_positions)
        else:
            x = x + self.positional(tokens.shape[1], start_pos)  # (L, E) broadcast over B
        return self.dropout(x)
