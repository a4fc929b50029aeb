"""Convert a trained checkpoint's attention to fewer K/V heads or a K/V latent.

python scripts/convert_kv_heads.py ckpt=RUN/checkpoints/last.ckpt num_kv_heads=2 out=gqa2.ckpt
python scripts/convert_kv_heads.py ckpt=RUN/checkpoints/last.ckpt kv_latent_dim=32 out=mla.ckpt
python scripts/convert_kv_heads.py ckpt=RUN/avg10.ckpt kv_latent_dim=16 rope_dim=16 \
    rotary_key=shared calibration_batches=8 out=mla.ckpt
python scripts/convert_kv_heads.py ckpt=RUN/avg10.ckpt cache_budget=0.25 calibration_batches=8 \
    out=mla.ckpt

Each K/V head of the new layers is the mean of a group of the trained ones (GQA paper), or
K/V come from a latent: a truncated SVD of the trained K/V weights, or the PCA of their
outputs on the run's first training batches (MLA); with calibration_batches, the options
left null (factorisation, balance_kv, rotary_key) are chosen per layer by the loss on the
held-out quarter of those batches; with cache_budget (bytes per token and sublayer, or a
fraction of its cache), so is the rotary keys' width against the latent's;
the printed command uptrains the converted model (add distill_from=CKPT to distil from
the original).
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
    options = {
        "rope_dim": cfg.rope_dim, "selection": cfg.selection, "rotary_key": cfg.rotary_key,
        "freqfold": cfg.freqfold, "factorisation": cfg.factorisation,
        "balance_kv": cfg.balance_kv, "calibration_batches": cfg.calibration_batches,
        "local_dir": cfg.local_dir,
    }  # fmt: skip
    out, overrides = convert_kv_heads(
        cfg.ckpt, cfg.num_kv_heads, cfg.out, scope, kv_latent_dim=cfg.kv_latent_dim,
        cache_budget=cfg.cache_budget, **options,
    )  # fmt: skip
    if cfg.num_kv_heads is not None:
        target = f"{cfg.num_kv_heads} K/V heads"
    elif cfg.kv_latent_dim is not None:
        target = f"a K/V latent of {cfg.kv_latent_dim}"
    else:
        target = f"a K/V latent within a cache budget of {cfg.cache_budget}"
    print(f"converted {cfg.ckpt} to {target} (scope={scope}) into {out}")
    print(
        "uptrain it (the GQA paper uses about 5% of the original steps) with the command "
        "below; it repeats the original run's overrides only if <run dir>/.hydra/"
        "overrides.yaml was found beside the checkpoint's folder:"
    )
    print(" ".join(["python scripts/train.py", *map(shlex.quote, overrides)]))


if __name__ == "__main__":
    main()
