"""bertviz views of one sentence: python scripts/attention_view.py ckpt=PATH sentence=... out=DIR

Writes ``head_view.html`` and ``model_view.html`` (bertviz, the ``[viz]`` extra) with the
encoder self-attention, decoder self-attention and cross-attention of every layer, the
decoder fed the model's greedy translation (:mod:`multihead.analysis.views`).
"""

from pathlib import Path

from multihead.cli import exit_on_user_error

import hydra
from omegaconf import DictConfig

from multihead.analysis.views import bertviz_pages, sentence_maps
from multihead.checkpoints import load_trained_model, search_settings, write_atomically


@hydra.main(version_base="1.3", config_path="../configs", config_name="attention_view")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    trained = load_trained_model(cfg.ckpt, backend=cfg.backend)
    maps = sentence_maps(
        trained.model, trained.tokenizer, str(cfg.sentence), search_settings(trained.config)
    )
    scripts = None if cfg.inline_js is None else {k: Path(v) for k, v in cfg.inline_js.items()}
    out = Path(cfg.out)
    for name, html in bertviz_pages(maps, scripts).items():
        write_atomically(out / f"{name}.html", lambda f, html=html: f.write(html.encode()))
    print(f"translation: {maps['translation']}")
    print(f"head_view.html and model_view.html written to {out}")


if __name__ == "__main__":
    main()
