"""The network a run config describes: the one factory for training and for checkpoints."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from multihead.model.transformer import ATTENTION_SUBLAYERS


def build_model(
    config: Mapping[str, Any], vocab_size: int, pad_id: int, *, backend: str | None = None
) -> nn.Module:
    """The network a run config describes: ``config.model`` with the heads of ``config.attention``.

    ``attention`` is the one place heads are set: its top-level keys apply to every
    attention sublayer, its ``encoder_self_attention`` / ``decoder_self_attention`` /
    ``cross_attention`` sections override them for one sublayer; ``match_parameters``
    (``mha``: the FFN widened to MHA's parameter count) goes to the model. ``backend``
    replaces every sublayer's backend (e.g. to translate with another kernel than the one
    trained with).
    """
    # Run configs are Hydra's (the `train` extra); the model itself needs torch alone.
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    attention = OmegaConf.to_container(OmegaConf.create(dict(config["attention"])), resolve=True)
    per_sublayer = {name: attention.pop(name, None) for name in ATTENTION_SUBLAYERS}
    # A control of the comparison, set beside the heads it controls (attention presets such
    # as gqa_h8_kv2_matched); the model widens its FFN.
    match = {"match_parameters": attention.pop("match_parameters", None)}
    if backend is not None:
        attention["backend"] = backend
        for section in per_sublayer.values():
            if section:
                section.pop("backend", None)
    target = str(config["model"].get("_target_", ""))
    if target.endswith("build_llama_lm"):  # HF's Llama: its heads alone come from attention
        # Its attention is HF's eager code, not the layer: a backend other than the attention
        # group's default would be accepted and never honoured, so it is refused.
        heads = ("num_heads", "num_kv_heads", "design_options")
        asked = {k: v for k, v in attention.items() if k not in heads and v not in (None, {})}
        asked |= {k: v for k, v in match.items() if v is not None}
        if asked.get("backend") == "sdpa":  # the group's default, which every preset carries
            del asked["backend"]
        for name, section in per_sublayer.items():
            if any(v not in (None, {}) for v in (section or {}).values()):
                asked[name] = section
        if asked:
            raise ValueError(
                f"attention {asked}: the HF Llama LM (model=llama_lm) takes only its heads "
                "from attention (num_heads, num_kv_heads)"
            )
        return instantiate(
            config["model"], vocab_size=vocab_size, pad_id=pad_id,
            num_heads=attention["num_heads"], num_kv_heads=attention["num_kv_heads"],
        )  # fmt: skip
    if target.endswith("DecoderLM"):
        for name in ("encoder_self_attention", "cross_attention"):
            given = {k: v for k, v in (per_sublayer[name] or {}).items() if v not in (None, {})}
            if given:
                raise ValueError(
                    f"attention.{name}={given}: the decoder-only LM has self-attention alone; "
                    "set its heads in attention (or attention.decoder_self_attention)"
                )
        return instantiate(
            config["model"],
            vocab_size=vocab_size,
            pad_id=pad_id,
            attention=attention,
            decoder_self_attention=per_sublayer["decoder_self_attention"],
            **match,
        )
    return instantiate(
        config["model"],
        src_vocab_size=vocab_size,
        tgt_vocab_size=vocab_size,
        pad_id=pad_id,
        attention=attention,
        **per_sublayer,
        **match,
    )


def check_model_config(config: Mapping[str, Any]) -> None:
    """Build the network a run config describes on the meta device, with a stand-in
    vocabulary: every check of the model and its layers (each sublayer's head design with
    its backend first), in no memory and before any data is loaded. Raises what building
    raises."""
    import torch

    with torch.device("meta"):
        build_model(config, vocab_size=8, pad_id=0)
