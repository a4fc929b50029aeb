"""Convert a trained checkpoint's attention to fewer K/V heads (MHA to GQA/MQA).

python scripts/convert_kv_heads.py ckpt=RUN/checkpoints/last.ckpt num_kv_heads=2 out=gqa2.ckpt

Each K/V head of the new layers is the mean of a group of the trained ones (GQA paper);
the printed command uptrains the converted model.
"""

import shlex

import hydra
from omegaconf import DictConfig, OmegaConf

from multihead.checkpoints.conversion import convert_kv_heads
from multihead.cli import exit_on_user_error


@hydra.main(version_base="1.3", config_path="../configs", config_name="convert")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    scope = OmegaConf.to_object(cfg.scope) if OmegaConf.is_list(cfg.scope) else cfg.scope
    out, overrides = convert_kv_heads(cfg.ckpt, cfg.num_kv_heads, cfg.out, scope)
    print(f"converted {cfg.ckpt} to {cfg.num_kv_heads} K/V heads (scope={scope}) into {out}")
    print(
        "uptrain it (the GQA paper uses about 5% of the original steps) with the command "
        "below; it repeats the original run's overrides only if <run dir>/.hydra/"
        "overrides.yaml was found beside the checkpoint's folder:"
    )
    print(" ".join(["python scripts/train.py", *map(shlex.quote, overrides)]))


if __name__ == "__main__":
    main()
