"""Average the last N checkpoints of a run, or the checkpoints you name, into a new one.

python scripts/average_checkpoints.py ckpt_dir=RUN/checkpoints last=5 out=RUN/avg.ckpt
python scripts/average_checkpoints.py 'ckpts=[RUN/a.ckpt,RUN/b.ckpt]' out=RUN/avg.ckpt
"""

from multihead.cli import exit_on_user_error

import hydra
from omegaconf import DictConfig

from multihead.checkpoints import save_new
from multihead.checkpoints.averaging import average_checkpoints, checkpoints_to_average


@hydra.main(version_base="1.3", config_path="../configs", config_name="average")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    ckpts = None if cfg.ckpts is None else list(cfg.ckpts)
    paths = checkpoints_to_average(cfg.ckpt_dir, cfg.last, ckpts)
    out = save_new(average_checkpoints(paths), cfg.out)
    print(f"averaged {len(paths)} checkpoints ({', '.join(p.name for p in paths)}) into {out}")


if __name__ == "__main__":
    main()
