"""Train a small Llama-shaped causal LM: python scripts/train_lm.py [overrides].

Writes to the run directory Lightning's checkpoints, ``csv/metrics.csv``, and at the end
the final model as ``hf/`` (``save_pretrained``), its tokenizer as ``tokenizer.json`` and
``summary.json`` (steps, final validation perplexity).

Example:
    python scripts/train_lm.py data.local_dir=../shared/data/multi30k hydra.run.dir=RUN
"""

import json
from pathlib import Path

from multihead.cli import exit_on_user_error, register_resolvers

import hydra
import lightning.pytorch as pl
from hydra.utils import instantiate
from omegaconf import DictConfig

register_resolvers()


@hydra.main(version_base="1.3", config_path="../configs", config_name="train_lm")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    pl.seed_everything(cfg.seed, workers=True)
    run_dir = Path(cfg.paths.output_dir)
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    model = instantiate(cfg.model, vocab_size=datamodule.vocab_size)
    module = instantiate(cfg.module, model=model)
    trainer = instantiate(
        cfg.trainer,
        callbacks=[instantiate(cfg.checkpoint)],
        logger=list(instantiate(cfg.logger).values()),
    )
    trainer.fit(module, datamodule=datamodule)
    final = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
    model.save_pretrained(run_dir / "hf")
    datamodule.tokenizer.save(run_dir / "tokenizer.json")
    summary = {
        "steps": trainer.global_step,
        "val/ppl": final["val/ppl"],
        "val/loss": final["val/loss"],
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
