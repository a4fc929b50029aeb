"""The model built from Hydra/OmegaConf configs: the training stack's side of the model
(the model itself imports torch alone: tests/model runs in the core install too)."""

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from helpers.models import VOCAB, tiny_model


def test_attention_config_accepts_dictconfig_and_rejects_unknown_keys():
    cfg = OmegaConf.create({"num_heads": 4, "num_kv_heads": None, "backend": "sdpa"})
    override = OmegaConf.create({"num_kv_heads": 2})
    model = tiny_model(attention=cfg, decoder_self_attention=override)
    assert model.head_config["decoder_self_attention"]["kind"] == "gqa"
    assert model.head_config["encoder_self_attention"]["kind"] == "mha"
    with pytest.raises(ValueError, match=r"\['heads'\] in cross_attention"):
        tiny_model(cross_attention={"heads": 2})
    with pytest.raises(TypeError, match="attention must be a mapping"):
        tiny_model(attention=4)


def test_hydra_instantiate_with_nested_attention_configs():
    cfg = OmegaConf.create(
        {
            "_target_": "multihead.model.Transformer",
            "src_vocab_size": VOCAB,
            "tgt_vocab_size": VOCAB,
            "d_model": 32,
            "ffn_dim": 64,
            "num_encoder_layers": 1,
            "num_decoder_layers": 1,
            "dropout": 0.1,
            "max_positions": 64,
            "attention": {"num_heads": 4, "num_kv_heads": None, "backend": "sdpa"},
            "decoder_self_attention": {"num_kv_heads": 2},
            "encoder_self_attention": None,
        }
    )
    model = instantiate(cfg)
    assert model.head_tag == "enc-mha4_dec-gqa4kv2_cross-mha4_sdpa"
