"""Train a translation Transformer: python scripts/train.py [overrides].

Examples:
    python scripts/train.py data.local_dir=../shared/data/multi30k
    python scripts/train.py experiment=smoke data.local_dir=../shared/data/multi30k logger=csv
    python scripts/train.py -m attention=mha,gqa,mqa trainer.max_steps=2000
"""

import hydra
from omegaconf import DictConfig

import multihead.training  # noqa: F401  (registers the config resolvers)
from multihead.training.config import exit_on_user_error
from multihead.training.run import train


@hydra.main(version_base="1.3", config_path="../configs", config_name="train")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
