"""KV-cache bytes per target token of the head comparison's decoder (d_model 128, 8 heads of
16, 4 layers, fp32): MHA, GQA, MQA and MLA, with and without MLA's decoupled rotary key.

    python docs/examples/kv_cache_bytes.py
"""

from multihead.model import Transformer


def mla(r: int, **rotary: int) -> dict:
    """The decoder self-attention config of MLA with a latent of ``r``."""
    return {"design": "mla", "design_options": {"kv_latent_dim": r}, **rotary}


DECODERS = {  # name: (decoder self-attention options, positional)
    "MHA 8/8": ({}, "sinusoidal"),
    "GQA 8/4": ({"num_kv_heads": 4}, "sinusoidal"),
    "GQA 8/2": ({"num_kv_heads": 2}, "sinusoidal"),
    "MQA 8/1": ({"num_kv_heads": 1}, "sinusoidal"),
    "MLA r = 32, no positions in the layer": (mla(32), "sinusoidal"),
    "MLA r = 32, rotary key d_R = 8": (mla(32, rotary_dim=8), "rope"),
    "MLA r = 32, rotary key d_R = 16 (rope's default: D)": (mla(32), "rope"),
    "MLA r = 16, rotary key d_R = 8": (mla(16, rotary_dim=8), "rope"),
}


def main() -> dict[str, int]:
    sizes = {}
    for name, (decoder, positional) in DECODERS.items():
        model = Transformer(
            src_vocab_size=8000, tgt_vocab_size=8000, d_model=128, ffn_dim=256,
            num_encoder_layers=4, num_decoder_layers=4, dropout=0.0, max_positions=512,
            positional=positional, attention={"num_heads": 8}, decoder_self_attention=decoder,
        )  # fmt: skip
        sizes[name] = model.kv_cache_bytes_per_token()
        print(f"| {name} | {sizes[name]:,} |")
    return sizes


if __name__ == "__main__":
    main()
