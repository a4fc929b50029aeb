"""Average the last N checkpoints of a run, or the checkpoints you name, into a new one.

python scripts/average_checkpoints.py ckpt_dir=RUN/checkpoints last=5 out=RUN/avg.ckpt
python scripts/average_checkpoints.py 'ckpts=[RUN/a.ckpt,RUN/b.ckpt]' out=RUN/avg.ckpt
"""

import hydra
from omegaconf import DictConfig

import multihead.training  # noqa: F401
from multihead.training.averaging import (
    average_checkpoints,
    chosen_checkpoints,
    recent_checkpoints,
    save_new,
)
from multihead.training.config import exit_on_user_error


@hydra.main(version_base="1.3", config_path="../configs", config_name="average")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    if (cfg.ckpt_dir is None) == (cfg.ckpts is None):
        raise ValueError(
            f"ckpt_dir={cfg.ckpt_dir}, ckpts={cfg.ckpts}; "
            "expected exactly one: ckpt_dir=DIR (with last=N) or ckpts=[A,B,...]"
        )
    if cfg.ckpts is not None:
        paths = chosen_checkpoints(list(cfg.ckpts))
    else:
        paths = recent_checkpoints(cfg.ckpt_dir, cfg.last)
    out = save_new(average_checkpoints(paths), cfg.out)
    print(f"averaged {len(paths)} checkpoints ({', '.join(p.name for p in paths)}) into {out}")


if __name__ == "__main__":
    main()
