"""Score a checkpoint: python scripts/evaluate.py ckpt=PATH [split=test] [beam_size=5].

Prints BLEU and writes the hypotheses and scores.json into outputs/evaluate/<time>/.
"""

import json

from multihead.cli import exit_on_user_error

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from multihead.evaluation import evaluate_checkpoint


@hydra.main(version_base="1.3", config_path="../configs", config_name="evaluate")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    out_dir = HydraConfig.get().runtime.output_dir
    result = evaluate_checkpoint(
        cfg.ckpt,
        out_dir,
        split=cfg.split,
        beam_size=cfg.beam_size,
        length_penalty=cfg.length_penalty,
        max_len_a=cfg.max_len_a,
        max_len_b=cfg.max_len_b,
        batch_size=cfg.batch_size,
        limit=cfg.limit,
        backend=cfg.backend,
        local_dir=cfg.data.local_dir,
        device=cfg.device,
    )
    print(json.dumps(result, indent=2))
    print(f"BLEU {result['bleu']:.2f}  ({result['bleu_signature']})")
    print(f"hypotheses written to {out_dir}/hypotheses.{cfg.split}.txt")


if __name__ == "__main__":
    main()
