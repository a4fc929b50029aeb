"""Train a translation Transformer: python scripts/train.py [overrides].

Examples:
    python scripts/train.py data.local_dir=../shared/data/multi30k
    python scripts/train.py experiment=smoke data.local_dir=../shared/data/multi30k logger=csv
    python scripts/train.py -m attention=mha,gqa,mqa trainer.max_steps=2000
    python scripts/train.py ... hydra.run.dir=RUN ckpt_path=last   # resume RUN
"""

from multihead.cli import exit_on_user_error, register_resolvers

import hydra
from omegaconf import DictConfig

from multihead.training.run import train

register_resolvers()


@hydra.main(version_base="1.3", config_path="../configs", config_name="train")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
