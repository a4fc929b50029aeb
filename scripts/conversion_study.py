"""Convert a trained MHA checkpoint to GQA and MLA at 1/k of its KV cache, score, uptrain, score.

python scripts/conversion_study.py ckpt=RUN/avg10.ckpt out=DIR [ratios=[2,4,8]] [beam_size=5]
python scripts/conversion_study.py ckpt=RUN/avg10.ckpt out=DIR \
    'methods=[mla_svd,mla_pca,mla_pca_bkv,mla_pca_bkv_shared]' [distill=true]

Writes DIR/rows.jsonl (one record per row), DIR/rows.csv and DIR/bleu_vs_uptraining.png
(see multihead.analysis.conversion_study).
"""

from multihead.cli import exit_on_user_error

import hydra
from omegaconf import DictConfig, OmegaConf

from multihead.analysis.conversion_study import run_study


@hydra.main(version_base="1.3", config_path="../configs", config_name="conversion_study")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    rows = run_study(
        cfg.ckpt,
        cfg.out,
        methods=list(cfg.methods),
        ratios=list(cfg.ratios),
        rope_dim=cfg.rope_dim,
        selection=cfg.selection,
        fractions=list(cfg.fractions),
        recipe=OmegaConf.to_object(cfg.recipe),
        calibration_batches=cfg.calibration_batches,
        distill=cfg.distill,
        beam_size=cfg.beam_size,
        local_dir=cfg.data.local_dir,
        limit=cfg.limit,
    )
    for row in rows:
        print(
            " ".join(
                f"{k}={row[k]}"
                for k in ("method", "ratio", "distill", "uptrain_steps", "bleu_lc_tok")
            )
        )
    print(f"rows written to {cfg.out}/rows.csv")


if __name__ == "__main__":
    main()
