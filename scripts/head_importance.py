"""Which heads matter: python scripts/head_importance.py ckpt=PATH out=DIR [limit=N]

For every attention sublayer and head of a checkpoint, over a split (teacher-forced on the
references): Michel's importance, Voita's confidence, the positional and rare-token shares
(:mod:`multihead.analysis.importance`), and the head's largest output similarity with another
head of its sublayer (the ρ matrices of ``head_diversity.py``). Writes ``heads.csv``, one
heatmap per metric (``<metric>.png``: layers x heads, one panel per sublayer kind), and the
pruning curve (``pruning.csv``, ``pruning.png``: greedy BLEU with the least important heads
masked, and beside it the parameters, BLEU and greedy speed of a copy with those heads pruned
for real; ``beside=[DIR,...]`` draws earlier outputs' curves in the same figure).
"""

import csv
import io
from pathlib import Path

from multihead.cli import exit_on_user_error

import hydra
import matplotlib.pyplot as plt
from omegaconf import DictConfig

from multihead.analysis.heads import similarity_matrices
from multihead.analysis.importance import (
    head_importance,
    head_roles,
    importance_rows,
    kv_group_size,
    max_similarity,
    normalise_per_layer,
    plot_heatmaps,
    plot_pruning_curve,
    pruning_curve,
    pruning_order,
    rare_token_ids,
    read_pruning_curve,
    token_counts,
)
from multihead.checkpoints import load_trained_model, search_settings, write_atomically
from multihead.data import load_parallel_dataset

LABELS = {
    "importance": "importance (Michel, l2-normalised per sublayer)",
    "confidence": "confidence (Voita: mean max weight)",
    "prev_share": "weight on the previous token",
    "next_share": "weight on the next token",
    "rare_share": "weight on rare tokens",
    "max_similarity": "largest cosine similarity with another head",
}


def write_csv(path: Path, rows: list[dict]) -> None:
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    write_atomically(path, lambda f: f.write(text.getvalue().encode()))


@hydra.main(version_base="1.3", config_path="../configs", config_name="head_importance")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    if cfg.limit is not None and cfg.limit < 1:
        raise ValueError(f"limit={cfg.limit}; expected a positive number of sentences or null")
    if cfg.speed_repeats < 1:
        raise ValueError(f"speed_repeats={cfg.speed_repeats}; expected a positive number of passes")
    if cfg.prune_by not in ("heads", "groups"):
        raise ValueError(f"prune_by={cfg.prune_by!r}; expected 'heads' or 'groups'")
    beside = {Path(d).name: read_pruning_curve(d) for d in cfg.beside}  # fail before the work
    trained = load_trained_model(cfg.ckpt, backend=cfg.backend)
    model, tokenizer = trained.model.to(cfg.device), trained.tokenizer
    # The pruning unit: one head, or a K/V group of them (checked before the long scoring).
    group_size = kv_group_size(model) if cfg.prune_by == "groups" else 1
    data = trained.config["data"]
    dataset = load_parallel_dataset(
        name=data["name"],
        src_lang=data["src_lang"],
        tgt_lang=data["tgt_lang"],
        local_dir=cfg.data.local_dir or data.get("local_dir"),
    )
    split = dataset[cfg.split]
    if cfg.limit is not None:
        split = split.select(range(min(cfg.limit, len(split))))
    pairs = list(zip(split["src"], split["tgt"], strict=True))
    train = dataset["train"]
    rare = {
        side: rare_token_ids(token_counts(tokenizer, train[side]), cfg.rare_quantile)
        for side in ("src", "tgt")
    }

    raw = head_importance(model, tokenizer, pairs, batch_size=cfg.batch_size)
    scores = {"importance": normalise_per_layer(raw), "importance_raw": raw}
    scores |= head_roles(model, tokenizer, pairs, rare, batch_size=cfg.batch_size)
    similarity = similarity_matrices(model, tokenizer, pairs, batch_size=cfg.batch_size)
    scores["max_similarity"] = max_similarity(similarity)
    out = Path(cfg.out)
    write_csv(out / "heads.csv", importance_rows(scores))
    name = Path(cfg.ckpt).parent.name
    for metric, label in LABELS.items():
        fig = plot_heatmaps(scores[metric], f"{name}: {label}, {len(pairs)} {cfg.split}", label)
        fig.savefig(out / f"{metric}.png", dpi=110)
        plt.close(fig)
    print(f"heads.csv and heatmaps written to {out}")

    if cfg.prune_fractions:
        rows = pruning_curve(
            model,
            tokenizer,
            split["src"],
            split["tgt"],
            pruning_order(scores["importance"], group_size),
            list(cfg.prune_fractions),
            search_settings(trained.config),
            speed_repeats=cfg.speed_repeats,
            unit=group_size,
        )
        write_csv(out / "pruning.csv", rows)
        curves = beside | {out.name: rows}
        fig = plot_pruning_curve(curves, f"greedy BLEU, {len(pairs)} {cfg.split}")
        fig.savefig(out / "pruning.png", dpi=110)
        plt.close(fig)
        for row in rows:
            pruned = "pruning refused (a whole sublayer or part of a GQA group)"
            if row["params_pruned"] is not None:
                pruned = (
                    f"pruned: {row['params_pruned']:,} params, BLEU {row['bleu_pruned']:.2f}, "
                    f"{row['sent_per_s_pruned']:.0f} sent/s against {row['sent_per_s']:.0f} "
                    f"({row['speedup_pruned']:.2f}x)"
                )
            print(f"{row['heads_kept']:4d} heads kept  BLEU {row['bleu']:.2f}  {pruned}")
        print(f"pruning.csv and pruning.png written to {out}")


if __name__ == "__main__":
    main()
