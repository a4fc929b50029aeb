"""Convert a trained checkpoint's attention to fewer K/V heads or a K/V latent.

python scripts/convert_kv_heads.py ckpt=RUN/checkpoints/last.ckpt num_kv_heads=2 out=gqa2.ckpt
python scripts/convert_kv_heads.py ckpt=RUN/checkpoints/last.ckpt kv_latent_dim=32 out=mla.ckpt

Each K/V head of the new layers is the mean of a group of the trained ones (GQA paper), or
K/V come from a latent found by a truncated SVD of the trained K/V weights (MLA); the
printed command uptrains the converted model.
"""

import shlex

from multihead.cli import exit_on_user_error

import hydra
from omegaconf import DictConfig, OmegaConf

from multihead.checkpoints.conversion import convert_kv_heads


@hydra.main(version_base="1.3", config_path="../configs", config_name="convert")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    scope = OmegaConf.to_object(cfg.scope) if OmegaConf.is_list(cfg.scope) else cfg.scope
    out, overrides = convert_kv_heads(
        cfg.ckpt, cfg.num_kv_heads, cfg.out, scope, kv_latent_dim=cfg.kv_latent_dim,
        rope_dim=cfg.rope_dim, selection=cfg.selection,
    )  # fmt: skip
    target = (
        f"{cfg.num_kv_heads} K/V heads"
        if cfg.kv_latent_dim is None
        else f"a K/V latent of {cfg.kv_latent_dim}"
    )
    print(f"converted {cfg.ckpt} to {target} (scope={scope}) into {out}")
    print(
        "uptrain it (the GQA paper uses about 5% of the original steps) with the command "
        "below; it repeats the original run's overrides only if <run dir>/.hydra/"
        "overrides.yaml was found beside the checkpoint's folder:"
    )
    print(" ".join(["python scripts/train.py", *map(shlex.quote, overrides)]))


if __name__ == "__main__":
    main()
