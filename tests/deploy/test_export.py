"""Export to CTranslate2: the exported model scores and translates as ours does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from multihead.attention import with_kv_heads
from multihead.checkpoints import load_trained_model
from multihead.deploy.engine import CTranslate2Engine
from multihead.deploy.export import ExportError, build_spec, export_ctranslate2
from multihead.evaluation import translate

from helpers.ct2_models import pairs, save_checkpoint, sentences, tokenizer
from helpers.scripts import fails_in_one_line, script_main

# The search settings every test translates with (the recipe's length limits).
SEARCH = dict(length_penalty=1.0, max_len_a=1.2, max_len_b=10)
ctranslate2 = pytest.importorskip("ctranslate2", reason="ctranslate2 is not installed (.[deploy])")

ROOT = Path(__file__).resolve().parents[2]
GQA = {"num_heads": 4, "num_kv_heads": 2, "backend": "sdpa"}
VARIANTS = {
    "post-LN MHA, separate embeddings, sinusoidal": {},
    "pre-LN GQA, shared embeddings, learned positions": dict(
        norm_first=True, positional="learned", share_embeddings=True, attention=GQA
    ),
    "MHA encoder, MQA decoder, GQA cross-attention, gelu": dict(
        activation="gelu",
        decoder_self_attention={"num_kv_heads": 1},
        cross_attention={"num_kv_heads": 2},
    ),
    # CTranslate2 has no MLA: written as the MHA layer of its weight products.
    "MLA decoder and cross-attention": dict(
        decoder_self_attention={"design": "mla", "design_options": {"kv_latent_dim": 16}},
        cross_attention={"design": "mla", "design_options": {"kv_latent_dim": 12}},
    ),
}


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def exported(request, tok, tmp_path_factory):
    """A random model of each variant, saved as a checkpoint and exported."""
    tmp = tmp_path_factory.mktemp("variant")
    save_checkpoint(tmp / "model.ckpt", tok, seed=3, **VARIANTS[request.param])
    return tmp / "model.ckpt", export_ctranslate2(ckpt=tmp / "model.ckpt", out=tmp / "ct2")


def test_scores_match_teacher_forced_log_probs(exported, tok):
    """CTranslate2's log-probabilities of reference targets equal our forward pass's."""
    ckpt, out = exported
    model = load_trained_model(ckpt).model
    vocabulary = CTranslate2Engine(out).vocabulary
    batch = pairs(8, seed=4)
    src_ids = [tok.encode(en) for en, _ in batch]
    tgt_ids = [tok.encode(de) for _, de in batch]
    results = ctranslate2.Translator(str(out)).score_batch(
        [[vocabulary[i] for i in ids] for ids in src_ids],
        [[vocabulary[i] for i in ids] for ids in tgt_ids],
        max_input_length=0,
    )
    for src, tgt, result in zip(src_ids, tgt_ids, results, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([src + [tok.eos_id]]), torch.tensor([[tok.bos_id, *tgt]]))
        expected = F.log_softmax(logits[0], dim=-1)  # (T, V): token t given bos + tgt[:t]
        targets = torch.tensor(tgt + [tok.eos_id])
        ours = expected.gather(1, targets[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(result.log_probs), ours, atol=1e-4, rtol=1e-4)


def test_greedy_output_is_identical(exported):
    """Greedy is cut to each sentence's own limit, so even a random model agrees exactly."""
    ckpt, out = exported
    loaded = load_trained_model(ckpt)
    source = sentences(48, seed=5)
    ours = translate(loaded.model, loaded.tokenizer, source, beam_size=1, batch_size=16, **SEARCH)
    theirs = CTranslate2Engine(out).translate(source, beam_size=1, batch_size=16, **SEARCH)
    assert theirs == ours
    assert len({len(s) for s in ours}) > 5  # varied lengths, some at the limit


def _trained(tok, tmp, variant: int):
    """A model trained briefly on the toy pairs, so its outputs end with eos."""
    save_checkpoint(tmp / "model.ckpt", tok, seed=1, steps=150, **VARIANTS[list(VARIANTS)[variant]])
    return tmp / "model.ckpt", export_ctranslate2(ckpt=tmp / "model.ckpt", out=tmp / "ct2")


@pytest.fixture(scope="module")
def trained(tok, tmp_path_factory):
    return _trained(tok, tmp_path_factory.mktemp("trained"), 2)


def test_loading_an_engine_keeps_torchs_thread_count(trained):
    """ctranslate2.Translator sets the process's OpenMP thread count; the engine puts torch's
    back (a training run after it would otherwise sum in another order)."""
    _, out = trained
    torch.set_num_threads(7)  # neither 1 nor a core count CTranslate2 would choose here
    CTranslate2Engine(out)
    assert torch.get_num_threads() == 7


@pytest.fixture(scope="module")
def trained_mla(tok, tmp_path_factory):
    return _trained(tok, tmp_path_factory.mktemp("trained_mla"), 3)


@pytest.mark.parametrize(("beam_size", "rate"), [(1, 1.0), (5, 0.98)])
@pytest.mark.parametrize("model", ["trained", "trained_mla"])
def test_trained_model_translations_match(request, model, beam_size, rate):
    ckpt, out = request.getfixturevalue(model)
    loaded = load_trained_model(ckpt)
    source = sentences(100, seed=6)
    ours = translate(loaded.model, loaded.tokenizer, source, beam_size=beam_size, **SEARCH)
    theirs = CTranslate2Engine(out).translate(source, beam_size=beam_size, **SEARCH)
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    assert len(differ) <= (1 - rate) * len(source), differ
    # Differences are the documented ones: beam searches that run into a length limit, which
    # ours ends at the sentence's own limit. Raised, the limit changes such a search's result.
    if differ:
        subset = [source[i] for i in differ]
        outputs = {
            limit_b: translate(
                loaded.model,
                loaded.tokenizer,
                subset,
                beam_size=beam_size,
                **{**SEARCH, "max_len_b": limit_b},
            )
            for limit_b in (SEARCH["max_len_b"], 200)
        }
        for i, limited, raised in zip(differ, *outputs.values(), strict=True):
            assert limited != raised, f"sentence {i} differs without reaching its length limit"
    # int8 is another model: with MKL (tests/conftest.py pins it) 84/100 greedy and 91/100
    # beam-5 outputs of this barely trained model agree on an AMD EPYC, 50+ on earlier
    # AVX-512 hosts; with oneDNN (a shell's CT2_USE_MKL=0, or another platform) 27-29/100.
    # The same model trained from seeds 2 and 3 agrees with it on 13-18, so either floor
    # tells the quantized model from another model.
    floor = 0.5 if os.environ.get("CT2_USE_MKL") == "1" else 0.2
    int8 = CTranslate2Engine(out, compute_type="int8").translate(
        source, beam_size=beam_size, **SEARCH
    )
    assert sum(a == b for a, b in zip(ours, int8, strict=True)) >= floor * len(source)


def run_readme_code(out: Path) -> str:
    """What the Python lines of the export's README print, run in a fresh interpreter."""
    readme = (out / "README.md").read_text()
    code = readme.split("```python\n")[1].split("```")[0]
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    return result.stdout.rstrip("\n")


def readme_search(engine: CTranslate2Engine, sentence: str) -> str:
    """The engine's translation with the README's settings: beam 5 and one fixed limit,
    max_positions - 1 = 127 tokens here."""
    return engine.translate(
        [sentence], beam_size=5, length_penalty=1.0, max_len_a=0, max_len_b=127
    )[0]


def test_readme_code_translates(ckpt, tmp_path):
    """The Python lines the export's README gives run and print the engine's translation."""
    out = export_ctranslate2(ckpt=ckpt, out=tmp_path / "ct2")
    assert run_readme_code(out) == readme_search(CTranslate2Engine(out), "A dog runs on the beach.")


def test_lowercase_tokenizer_lowercases_exported_input(tmp_path):
    """The Lowercase normalizer travels in the exported tokenizer.json: the engine and the
    README's plain-tokenizers code lowercase their input as our translate does."""
    path = tmp_path / "model.ckpt"
    save_checkpoint(path, tokenizer(lowercase=True), seed=3)
    out = export_ctranslate2(ckpt=path, out=tmp_path / "ct2")
    loaded = load_trained_model(path)
    source = sentences(16, seed=5)
    lowered = [s.lower() for s in source]
    assert lowered != source
    ours = translate(loaded.model, loaded.tokenizer, source, beam_size=1, **SEARCH)
    engine = CTranslate2Engine(out)
    assert engine.translate(source, beam_size=1, **SEARCH) == ours
    assert engine.translate(lowered, beam_size=1, **SEARCH) == ours
    # The README translates "A dog runs on the beach.": its tokenizer lowercases it.
    assert run_readme_code(out) == readme_search(engine, "a dog runs on the beach.")


# ---------------------------------------------------------------- what cannot be exported


def test_heads_differing_between_layers_are_refused(tok, tmp_path):
    model = save_checkpoint(tmp_path / "m.ckpt", tok)
    model.decoder_layers[1].self_attn = with_kv_heads(model.decoder_layers[1].self_attn, 1)
    with pytest.raises(ExportError, match="decoder_self_attention .* differing between layers"):
        build_spec(model, tok)


def test_unknown_head_design_is_refused(tok, tmp_path):
    model = save_checkpoint(tmp_path / "m.ckpt", tok)
    model.encoder_layers[0].self_attn = nn.MultiheadAttention(32, 4, batch_first=True)
    with pytest.raises(ExportError, match="encoder_self_attention is a MultiheadAttention"):
        build_spec(model, tok)


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        (
            {"design": "moh", "design_options": {"top_k_heads": 2}},
            r"head design 'mha4-moh-k2'; CTranslate2 runs plain",
        ),
        ({"design": "group_mlp"}, r"head design 'mha4-group_mlp2'"),
        (
            {"design": "mla", "design_options": {"kv_latent_dim": 8, "kv_latent_norm": True}},
            r"'mla' \(r8n\) has kv_latent_norm, "
            "which no MHA layer computes: it has no MHA equivalent; CTranslate2 runs MLA as",
        ),
    ],
)
def test_head_designs_ctranslate2_cannot_run_are_refused(tok, tmp_path, options, pattern):
    model = save_checkpoint(tmp_path / "m.ckpt", tok, cross_attention=options)
    with pytest.raises(ExportError, match=r"cross_attention .*" + pattern):
        build_spec(model, tok)


@pytest.mark.parametrize(
    ("positional", "pattern"),
    [("alibi", r"\(ALiBi: positional='alibi'\) cannot be exported: CTranslate2 \(4.8\) has "
      "ALiBi in its decoder spec only"), ("rope", "positional='rope' cannot be exported yet")],
)  # fmt: skip
def test_positions_in_the_attention_are_refused_by_name(tok, tmp_path, positional, pattern):
    model = save_checkpoint(tmp_path / "m.ckpt", tok, positional=positional)
    with pytest.raises(ExportError, match=pattern):
        build_spec(model, tok)


def test_decoder_query_heads_must_agree(tok, tmp_path):
    model = save_checkpoint(
        tmp_path / "m.ckpt", tok, cross_attention={"num_heads": 2, "num_kv_heads": None}
    )
    with pytest.raises(
        ExportError, match="decoder_self_attention has 4 query heads but cross_attention 2"
    ):
        build_spec(model, tok)


# ---------------------------------------------------------------- files and the CLI


@pytest.fixture(scope="module")
def ckpt(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "model.ckpt"
    save_checkpoint(path, tok)
    return path


def test_bad_checkpoints_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        export_ctranslate2(ckpt=tmp_path / "missing.ckpt", out=tmp_path / "out")
    (tmp_path / "notes.ckpt").write_text("hello")
    with pytest.raises(ValueError, match="is not a readable checkpoint"):
        export_ctranslate2(ckpt=tmp_path / "notes.ckpt", out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_output_is_kept_unless_overwrite(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty; pass overwrite=true"):
        export_ctranslate2(ckpt=ckpt, out=out)
    assert (out / "keep.txt").read_text() == "mine"
    export_ctranslate2(ckpt=ckpt, out=out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.bin").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left


def test_overwrite_takes_a_bool_only_and_keeps_the_output(tmp_path):
    """overwrite="no" replaced the output (a truthy string; issue 84)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"^overwrite must be a bool, got 'no'$"):
        export_ctranslate2(ckpt=tmp_path / "a.ckpt", out=out, overwrite="no")
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_failed_export_leaves_the_old_output(ckpt, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")

    def fail(self, path):
        raise OSError("disk full")

    monkeypatch.setattr("multihead.data.Tokenizer.save", fail)
    with pytest.raises(OSError, match="disk full"):
        export_ctranslate2(ckpt=ckpt, out=out, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_missing_ctranslate2_is_refused(ckpt, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # makes the import fail
    with pytest.raises(ExportError, match=r"ctranslate2 is not installed.*\.\[deploy\]"):
        export_ctranslate2(ckpt=ckpt, out=tmp_path / "out")


def _export_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "export.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


def test_cli_bad_input_is_one_line_exit_2(ckpt, tmp_path, capsys):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    # The one process: the wrapper as a shell sees it. The other refusals run in this process
    # (below) or on export_ctranslate2 itself.
    result = _export_cli(f"ckpt={ckpt}", f"out={busy}")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "is not empty" in lines[0]
    args = (f"ckpt={ckpt}", "format=onnx", f"out={tmp_path / 'x'}")
    line = fails_in_one_line(script_main, capsys, "export.py", "export", *args)
    assert "unknown format 'onnx'" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]


def test_cli_exports(ckpt, tmp_path):
    script_main(
        "export.py", "export", f"ckpt={ckpt}", "format=ctranslate2", f"out={tmp_path / 'model'}"
    )
    names = {p.name for p in (tmp_path / "model").iterdir()}
    assert {"model.bin", "config.json", "shared_vocabulary.json", "README.md"} <= names


def test_translate_cli_with_ctranslate2(ckpt, tmp_path, capsys):
    out = export_ctranslate2(ckpt=ckpt, out=tmp_path / "ct2")
    source = sentences(5, seed=8)
    (tmp_path / "in.txt").write_text("\n".join(source) + "\n")
    script = str(ROOT / "scripts" / "translate.py")
    args = [f"model_dir={out}", f"input={tmp_path / 'in.txt'}", "beam_size=5"]
    result = subprocess.run(
        [sys.executable, script, "engine=ctranslate2", *args, "compute_type=int8"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    expected = CTranslate2Engine(out, compute_type="int8").translate(source, beam_size=5, **SEARCH)
    # One translation per "\n"-terminated line; splitlines() would also split on the \x0b
    # or \x1c an untrained model can emit.
    assert result.stdout.split("\n") == [*expected, ""]
    # Its error path in this process (tests/scripts/test_translate_script.py runs one in a
    # process of its own).
    line = fails_in_one_line(script_main, capsys, "translate.py", "translate", *args)
    assert line == "error: engine=torch needs ckpt=PATH"


def _benchmark(ckpt: Path, multi30k_dir: Path, *options: str) -> tuple[str, list[list[str]]]:
    """Run benchmark_decoding.py on 6 test sentences: its output and its table's rows."""
    script = str(ROOT / "scripts" / "benchmark_decoding.py")
    args = [str(ckpt), "--local-dir", str(multi30k_dir), "--limit", "6", "--repeats", "1"]
    result = subprocess.run(
        [sys.executable, script, *args, "--threads", "1", *options],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith(f"| {ckpt} |")]
    return result.stdout, [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines]


@pytest.mark.slow  # benchmark_decoding.py, then a process per engine
def test_benchmark_decoding_one_engine_per_process(trained, multi30k_dir, tmp_path):
    # The recipe's checkpoints name their dataset; the toy one does not.
    state = torch.load(trained[0], weights_only=False)
    state["multihead"]["config"]["data"]["name"] = "multi30k"
    ckpt = tmp_path / "model.ckpt"
    torch.save(state, ckpt)

    out, rows = _benchmark(ckpt, multi30k_dir, "--engines", "ours", "ct2-fp32")
    both = {row[1]: row for row in rows}
    assert sorted(both) == ["ct2 fp32", "ours"]
    assert out.startswith("cpu: ") and "CTranslate2 fp32 GEMM: " in out.splitlines()[0]
    # Columns: ..., greedy sent/s, ratio, words/s, BLEU, same as ours, beam the same.
    assert both["ct2 fp32"][8] == "6/6"  # greedy is cut to our per-sentence limits: identical
    assert float(both["ct2 fp32"][4].replace(",", "")) > 0
    # --alternate: each engine in its own process, two rounds; the identity with ours is
    # counted across processes. Columns: checkpoint, round, engine, then per search
    # sent/s, ratio, BLEU, same as ours.
    _, rows = _benchmark(ckpt, multi30k_dir, "--alternate", "2", "--engines", "ours", "ct2-fp32")
    assert [(row[1], row[2]) for row in rows] == [
        ("1", "ours"),
        ("1", "ct2 fp32"),
        ("2", "ours"),
        ("2", "ct2 fp32"),
    ]
    assert all(row[6] == "6/6" for row in rows)  # greedy identical in every round


@pytest.mark.slow  # benchmark_decoding.py --profile, greedy and beam
def test_benchmark_decoding_profile_times_every_part_of_a_step(trained, multi30k_dir, tmp_path):
    state = torch.load(trained[0], weights_only=False)
    state["multihead"]["config"]["data"]["name"] = "multi30k"
    ckpt = tmp_path / "model.ckpt"
    torch.save(state, ckpt)
    out, _ = _benchmark(ckpt, multi30k_dir, "--profile")
    for search in ("greedy", "beam5"):
        table = out.split(f"\n{search}: ")[1].split("\n\n")[0]
        rows = [line.split("|") for line in table.splitlines()[3:]]
        # Milliseconds, not the rounded share: on a loaded machine the wall time grows and a
        # small part's share can round to 0.0%.
        ms = {row[1].strip(): float(row[3]) for row in rows}
        # The op names of each part are those the decoder runs: none is left at zero.
        assert len(ms) == 8 and all(t > 0 for t in ms.values()), ms
