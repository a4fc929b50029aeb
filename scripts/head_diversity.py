"""Head diversity of trained checkpoints: python scripts/head_diversity.py 'ckpts=[A,B]' out=DIR

For every checkpoint, the full matrix of pairwise cosine similarities of head outputs
per sublayer and layer, over the first N sentences of a split (teacher-forced on the
references): one figure per checkpoint, ``<label>_head_similarity.png``, and
``head_diversity.md`` with the mean off-diagonal similarity of every layer.
"""

from pathlib import Path

from multihead.cli import exit_on_user_error

import hydra
import matplotlib.pyplot as plt
from omegaconf import DictConfig

from multihead.analysis.heads import (
    diversity_markdown,
    plot_similarity_matrices,
    similarity_matrices,
)
from multihead.checkpoints import load_trained_model, write_atomically
from multihead.data import load_parallel_dataset


@hydra.main(version_base="1.3", config_path="../configs", config_name="head_diversity")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    ckpts = list(cfg.ckpts)
    labels = list(cfg.labels) if cfg.labels is not None else [Path(c).parent.name for c in ckpts]
    if not ckpts or len(labels) != len(ckpts):
        raise ValueError(f"ckpts={ckpts}, labels={labels}; expected one label per checkpoint")
    out = Path(cfg.out)
    per_model = {}
    for label, ckpt in zip(labels, ckpts, strict=True):
        trained = load_trained_model(ckpt)
        data = trained.config["data"]
        split = load_parallel_dataset(
            name=data["name"],
            src_lang=data["src_lang"],
            tgt_lang=data["tgt_lang"],
            local_dir=cfg.data.local_dir or data.get("local_dir"),
        )[cfg.split]
        split = split.select(range(min(cfg.sentences, len(split))))
        pairs = list(zip(split["src"], split["tgt"], strict=True))
        per_model[label] = similarity_matrices(trained.model, trained.tokenizer, pairs)
        fig = plot_similarity_matrices(
            per_model[label],
            f"{label}: cosine similarity of head outputs ({len(pairs)} {cfg.split})",
        )
        out.mkdir(parents=True, exist_ok=True)
        fig.savefig(out / f"{label}_head_similarity.png", dpi=110)
        plt.close(fig)
    text = diversity_markdown(per_model)
    write_atomically(out / "head_diversity.md", lambda f: f.write(text.encode()))
    print(text)
    print(f"figures and table written to {out}")


if __name__ == "__main__":
    main()
