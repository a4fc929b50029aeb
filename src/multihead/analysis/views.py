"""bertviz's head view and model view of one sentence, for a person to look at.

The decoder side is the model's own greedy translation, teacher-forced back in, so the maps
are those the model computes while translating. bertviz is the optional ``[viz]`` extra.
bertviz's pages load require.js, d3 and jQuery from a CDN when opened; offline, pass
``scripts`` (their local files) to inline them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from multihead.analysis.heads import token_labels

# The CDN addresses bertviz's pages load, and the module each provides.
CDN = {
    "require": "https://cdnjs.cloudflare.com/ajax/libs/require.js/2.3.6/require.min.js",
    "d3": "https://cdnjs.cloudflare.com/ajax/libs/d3/5.7.0/d3.min",
    "jquery": "https://cdnjs.cloudflare.com/ajax/libs/jquery/2.0.0/jquery.min",
}


def sentence_maps(
    model: nn.Module, tokenizer: Any, sentence: str, search: dict[str, float]
) -> dict[str, Any]:
    """The maps of ``sentence`` and its greedy translation: ``{"encoder_attention",
    "decoder_attention", "cross_attention"}`` (lists of ``(1, H, L, S)`` per layer, bertviz's
    arguments), ``encoder_tokens``, ``decoder_tokens`` and ``translation``."""
    from multihead.data import collate
    from multihead.model import decode

    ids = dict(pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    example = {"src_ids": tokenizer.encode(sentence), "tgt_ids": [], "src": "", "tgt": ""}
    device = next(model.parameters()).device
    src = collate([example], **ids)["src"].to(device)  # (1, S): ids + eos
    model.eval()
    with torch.no_grad():
        hyp = decode(
            model, src, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, beam_size=1, **search
        )[0]
        tgt_in = torch.tensor([[tokenizer.bos_id, *hyp]], device=device)  # (1, T)
        maps = model.attention_maps(src, tgt_in)
    return {
        "encoder_attention": [m.cpu() for m in maps["encoder_self"]],
        "decoder_attention": [m.cpu() for m in maps["decoder_self"]],
        "cross_attention": [m.cpu() for m in maps["cross"]],
        "encoder_tokens": token_labels(tokenizer, src[0].cpu()),
        "decoder_tokens": token_labels(tokenizer, tgt_in[0].cpu()),
        "translation": tokenizer.decode(hyp),
    }


def bertviz_pages(maps: dict[str, Any], scripts: dict[str, Path] | None = None) -> dict[str, str]:
    """``{"head_view": html, "model_view": html}``, whole pages, from :func:`sentence_maps`.

    ``scripts`` maps ``require``, ``d3`` and ``jquery`` to local files to inline in place of
    the CDN: d3 5 as bertviz asks, or d3 3 (Debian's ``libjs-d3``), which lacks only the
    ``d3.schemeCategory10`` palette bertviz's model view reads; it is added from
    ``d3.scale.category10()``.
    """
    try:
        from bertviz import head_view, model_view
    except ImportError as error:
        raise ImportError(
            "the attention views need bertviz: pip install 'multihead[viz]'"
        ) from error
    arguments = {k: v for k, v in maps.items() if k != "translation"}
    pages = {}
    for name, view in (("head_view", head_view), ("model_view", model_view)):
        html = view(**arguments, html_action="return").data
        if scripts is not None:
            html = inline_scripts(html, scripts)
        title = f"{name}: {maps['translation']}"
        pages[name] = (
            f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{title}</title></head>"
            f"<body>\n{html}\n</body></html>\n"
        )
    return pages


def inline_scripts(html: str, scripts: dict[str, Path]) -> str:
    """``html`` with require.js, d3 and jQuery read from ``scripts`` instead of the CDN.

    d3 and jQuery register as AMD modules with require.js's ``define`` when it is loaded
    first, so they are defined under their names and bertviz's ``require.config`` paths
    (the CDN) are never fetched.
    """
    missing = sorted(set(CDN) - set(scripts))
    if missing:
        raise ValueError(f"scripts needs files for {', '.join(CDN)}; missing {missing}")
    require = f'<script src="{CDN["require"]}"></script>'
    if require not in html:
        raise ValueError("the bertviz page does not load require.js from the expected address")
    code = {name: Path(path).read_text(encoding="utf-8") for name, path in scripts.items()}
    # Each library runs with define() hidden, so it sets its global, then is defined as a
    # named module: bertviz's requirejs(['jquery', 'd3'], ...) finds both without a fetch.
    d3_v3 = (
        "if (!d3.schemeCategory10 && d3.scale) d3.schemeCategory10 = d3.scale.category10().range();"
    )
    local = "\n".join(
        [
            f"<script>{code['require']}</script>",
            f"<script>(function (define) {{ {code['d3']}\n}}).call(window);\n{d3_v3}\n"
            "define('d3', [], function () { return d3; });</script>",
            f"<script>(function (define) {{ {code['jquery']}\n}}).call(window);\n"
            "define('jquery', [], function () { return jQuery; });</script>",
        ]
    )
    html = re.sub(r"require\.config\(\{.*?\}\);", "", html, count=1, flags=re.S)  # the CDN
    return html.replace(require, local)
