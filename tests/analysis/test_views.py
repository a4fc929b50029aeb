"""bertviz views: the pages as written, opened in headless Chromium."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch

from multihead.analysis.views import CDN, bertviz_pages, inline_scripts, sentence_maps

from helpers.models import SENTENCES, analysis_model
from helpers.scripts import run_script

pytest.importorskip("bertviz", reason="bertviz is the [viz] extra")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium)"
)
# Debian's libjs-requirejs, libjs-d3 (3.5) and libjs-jquery: the pages offline.
DEBIAN_JS = {
    "require": Path("/usr/share/javascript/requirejs/require.min.js"),
    "d3": Path("/usr/share/javascript/d3/d3.min.js"),
    "jquery": Path("/usr/share/javascript/jquery/jquery.min.js"),
}
needs_js = pytest.mark.skipif(
    not all(p.exists() for p in DEBIAN_JS.values()),
    reason="no local require.js/d3/jQuery (Debian: apt-get install libjs-requirejs libjs-d3 "
    "libjs-jquery); the pages load them from a CDN, and this machine is offline",
)
SEARCH = {"length_penalty": 1.0, "max_len_a": 1.0, "max_len_b": 5}


@pytest.fixture(scope="module")
def tokenizer():
    from multihead.data import Tokenizer

    return Tokenizer.train([t for pair in SENTENCES for t in pair] * 5, vocab_size=300)


def open_in_chromium(page: Path, tmp_path: Path) -> tuple[str, np.ndarray]:
    """The DOM after the page's scripts ran, and a screenshot ``(H, W, channels)``."""
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000"]
    url = page.resolve().as_uri()
    dom = subprocess.run(
        [*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    shot = tmp_path / f"{page.stem}.png"
    subprocess.run(
        [*flags, f"--screenshot={shot}", "--window-size=1000,800", url],
        capture_output=True,
        timeout=120,
        check=True,
    )
    return dom, matplotlib.image.imread(shot)


def drawn_text(dom: str) -> list[str]:
    """The text of the SVG ``<text>`` elements d3 drew (not the data in the scripts)."""
    return re.findall(r"<text[^>]*>([^<]*)</text>", dom)


def test_maps_are_the_models_for_the_sentence_and_its_translation(tokenizer):
    model = analysis_model(tokenizer.vocab_size)
    maps = sentence_maps(model, tokenizer, "A dog runs.", SEARCH)
    S, T = len(maps["encoder_tokens"]), len(maps["decoder_tokens"])
    assert maps["encoder_tokens"][-1] == "<eos>" and maps["decoder_tokens"][0] == "<bos>"
    assert [m.shape for m in maps["encoder_attention"]] == [(1, 4, S, S)] * 2
    assert [m.shape for m in maps["decoder_attention"]] == [(1, 4, T, T)] * 2
    assert [m.shape for m in maps["cross_attention"]] == [(1, 4, T, S)] * 2
    src = torch.tensor([tokenizer.encode("A dog runs.") + [tokenizer.eos_id]])
    tgt_in = torch.tensor([[tokenizer.bos_id] + tokenizer.encode(maps["translation"])])
    with torch.no_grad():
        expected = model.attention_maps(src, tgt_in)["cross"][1]
    torch.testing.assert_close(maps["cross_attention"][1], expected)


def test_inlining_needs_every_script(tmp_path):
    with pytest.raises(ValueError, match=r"missing \['jquery'\]"):
        inline_scripts("", {"require": tmp_path, "d3": tmp_path})


@needs_chromium
@needs_js
def test_pages_render_in_headless_chromium(tokenizer, tmp_path):
    model = analysis_model(tokenizer.vocab_size)
    maps = sentence_maps(model, tokenizer, "A dog runs in the park.", SEARCH)
    pages = bertviz_pages(maps, DEBIAN_JS)
    assert not any(url in html for html in pages.values() for url in CDN.values())
    for name, html in pages.items():
        (tmp_path / f"{name}.html").write_text(html, encoding="utf-8")

    dom, shot = open_in_chromium(tmp_path / "head_view.html", tmp_path)
    text = drawn_text(dom)
    # The encoder's tokens, drawn on both sides of the head view (the first view shown).
    tokens = [t for t in maps["encoder_tokens"] if t.isalpha()]
    assert tokens and all(text.count(t) >= 2 for t in tokens)
    assert "<line" in dom  # the attention lines
    assert (shot[..., :3] < 0.9).any(axis=-1).mean() > 0.02  # not a blank page

    dom, shot = open_in_chromium(tmp_path / "model_view.html", tmp_path)
    assert {"Layers", "Heads"} <= set(drawn_text(dom))
    assert dom.count("<line") > 4 * 2 * len(maps["encoder_tokens"])  # every head's thumbnail
    assert (shot[..., :3] < 0.5).any(axis=-1).mean() > 0.3  # the dark thumbnails fill it


@needs_chromium
@needs_js
def test_attention_view_script_writes_pages_that_render(smoke_run_dir, tmp_path):
    ckpt = smoke_run_dir / "checkpoints" / "last.ckpt"
    inline = ",".join(f"{k}:{v}" for k, v in DEBIAN_JS.items())
    result = run_script(
        "attention_view.py",
        f"ckpt={ckpt}",
        "sentence=A dog runs in the park.",
        f"out={tmp_path}",
        f"inline_js={{{inline}}}",
    )
    assert result.returncode == 0, result.stderr
    assert "translation:" in result.stdout
    dom, _ = open_in_chromium(tmp_path / "head_view.html", tmp_path)
    assert "park" in "".join(drawn_text(dom))
    page = (tmp_path / "model_view.html").read_text()
    assert '"name": "Cross"' in page and '"name": "Decoder"' in page
