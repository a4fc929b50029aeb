import math

import pytest
import torch

from multihead.model import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    TransformerEmbedding,
    make_token_embedding,
)


def test_sinusoidal_matches_the_paper_formula():
    E = 6
    pe = SinusoidalPositionalEncoding(E, max_positions=20)
    table = pe(20)
    for pos in (0, 3, 17):
        for i in range(E // 2):
            angle = pos / 10000 ** (2 * i / E)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    assert "table" not in pe.state_dict()  # rebuilt from the formula, not checkpointed


def test_sinusoidal_odd_dim_and_offset():
    pe = SinusoidalPositionalEncoding(5, max_positions=10)
    assert pe(10).shape == (10, 5)
    assert torch.equal(pe(3, start_pos=4), pe(10)[4:7])


@pytest.mark.parametrize("cls", [SinusoidalPositionalEncoding, LearnedPositionalEmbedding])
def test_positions_past_max_positions_raise(cls):
    pe = cls(8, max_positions=10)
    assert pe(2, start_pos=8).shape == (2, 8)
    with pytest.raises(ValueError, match="max_positions=10"):
        pe(3, start_pos=8)


def test_token_embedding_init_scale_and_pad_row():
    emb = make_token_embedding(1000, 64, pad_id=3)
    assert torch.all(emb.weight[3] == 0)
    assert emb.weight.std().item() == pytest.approx(64**-0.5, rel=0.05)
    with pytest.raises(ValueError, match="pad_id"):
        make_token_embedding(10, 8, pad_id=10)


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_transformer_embedding_is_scaled_sum(positional):
    torch.manual_seed(0)
    token = make_token_embedding(20, 16, pad_id=0)
    layer = TransformerEmbedding(token, positional=positional, max_positions=12, dropout=0.0)
    ids = torch.tensor([[5, 6, 0], [7, 0, 0]])
    expected = token(ids) * 4.0 + layer.positional(3, start_pos=2)
    assert torch.allclose(layer(ids, start_pos=2), expected)


def test_unknown_positional_raises():
    token = make_token_embedding(20, 16, pad_id=0)
    with pytest.raises(ValueError, match="'rotary'.*sinusoidal, learned, rope, alibi"):
        TransformerEmbedding(token, positional="rotary", max_positions=12, dropout=0.0)
