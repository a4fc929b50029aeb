"""Head importance against finite differences, roles against loops, pruning curves."""

from __future__ import annotations

import csv

import pytest
import torch

from multihead.analysis.importance import (
    batch_loss,
    batches,
    head_importance,
    head_roles,
    kv_group_size,
    masked_heads,
    max_similarity,
    normalise_per_layer,
    plot_pruning_curve,
    prune_model,
    pruning_curve,
    pruning_order,
    rare_token_ids,
    read_pruning_curve,
    sublayers,
    token_counts,
)
from multihead.evaluation.translate import translate

from helpers.models import SENTENCES, analysis_model
from helpers.scripts import assert_one_error_line, fails_in_one_line, run_script, script_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tokenizer():
    from multihead.data import Tokenizer

    return Tokenizer.train([t for pair in SENTENCES for t in pair] * 5, vocab_size=300)


def test_importance_matches_finite_differences(tokenizer):
    # float64 with SDPA (the math backend's softmax runs in float32, too noisy for a finite
    # difference), so the central difference is accurate to ~eps^2; two batches (2 + 1
    # pairs), so the mean of |dL/dg| over batches is checked too.
    model = analysis_model(tokenizer.vocab_size, backend="sdpa").double()
    raw = head_importance(model, tokenizer, SENTENCES, batch_size=2)
    assert set(raw) == {"encoder_self", "decoder_self", "cross"}
    assert all(v.shape == (2, 4) for v in raw.values())
    eps = 1e-5
    data = list(batches(tokenizer, SENTENCES, 2, "cpu"))
    for kind, layer, head in [("encoder_self", 0, 1), ("decoder_self", 1, 3), ("cross", 0, 2)]:
        attn = {(k, i): a for k, i, a in sublayers(model)}[(kind, layer)]
        diffs = []
        for batch in data:
            losses = []
            for sign in (1, -1):
                gate = torch.ones(4, dtype=torch.float64)
                gate[head] += sign * eps
                attn.head_mask = gate
                with torch.no_grad():
                    losses.append(float(batch_loss(model, *batch, tokenizer.pad_id)))
            attn.head_mask = None
            diffs.append(abs(losses[0] - losses[1]) / (2 * eps))
        expected = sum(diffs) / len(diffs)
        assert expected > 1e-4  # the head matters: the check is not 0 == 0
        assert float(raw[kind][layer, head]) == pytest.approx(expected, rel=1e-5)
    assert all(attn.head_mask is None for *_, attn in sublayers(model))  # gates removed


def test_normalised_importance_has_unit_norm_per_sublayer():
    raw = {"cross": torch.tensor([[3.0, 4.0], [1.0, 0.0]])}
    assert torch.equal(normalise_per_layer(raw)["cross"], torch.tensor([[0.6, 0.8], [1.0, 0.0]]))


def test_rare_tokens_by_hand(tokenizer):
    counts = torch.tensor([5, 0, 1, 3, 1])  # 10 tokens: ids 1, 2, 4 make up 2 <= 3 of them
    assert rare_token_ids(counts, 0.3).tolist() == [False, True, True, False, True]
    with pytest.raises(ValueError, match="rare_quantile must be in"):
        rare_token_ids(counts, 1.0)
    counted = token_counts(tokenizer, ["Ein Hund", "Ein Park"])
    ein = tokenizer.encode("Ein")
    assert (
        int(counted.sum())
        == len(tokenizer.encode("Ein Hund")) + len(tokenizer.encode("Ein Park")) + 2
    )  # eos per sentence
    assert all(counted[i] >= 2 for i in ein)


def test_roles_match_loops_over_the_maps(tokenizer):
    model = analysis_model(tokenizer.vocab_size, backend="math")
    rare_ids = torch.zeros(tokenizer.vocab_size, dtype=torch.bool)
    rare_ids[tokenizer.encode("Hund Park Buch")] = True
    rare = {"src": rare_ids, "tgt": rare_ids}
    roles = head_roles(model, tokenizer, SENTENCES, rare, batch_size=2)
    # The reference: one sentence at a time (no padding), plain loops over positions.
    sums = {m: torch.zeros(4) for m in ("confidence", "prev", "next", "rare")}
    n = 0
    for src, tgt_in, _ in batches(tokenizer, SENTENCES, 1, "cpu"):
        with torch.no_grad():
            w = model.attention_maps(src, tgt_in)["decoder_self"][1][0]  # (H, T, T)
        T = w.shape[1]
        for t in range(T):
            sums["confidence"] += w[:, t].max(dim=-1).values
            sums["prev"] += w[:, t, t - 1] if t > 0 else 0
            sums["next"] += w[:, t, t + 1] if t + 1 < T else 0
            sums["rare"] += sum(w[:, t, s] for s in range(T) if rare_ids[tgt_in[0, s]])
        n += T
    for metric, name in [("confidence", "confidence"), ("prev_share", "prev"),
                         ("next_share", "next"), ("rare_share", "rare")]:  # fmt: skip
        torch.testing.assert_close(roles[metric]["decoder_self"][1], sums[name] / n)
    assert torch.equal(roles["next_share"]["decoder_self"], torch.zeros(2, 4))  # causal
    assert roles["prev_share"]["cross"].isnan().all()
    assert float(roles["rare_share"]["decoder_self"].sum()) > 0


def test_pruning_curve_masks_the_least_important_heads_first(tokenizer):
    model = analysis_model(tokenizer.vocab_size)
    importance = {
        "encoder_self": torch.arange(8.0).view(2, 4),
        "decoder_self": torch.arange(8.0, 16.0).view(2, 4),
        "cross": torch.arange(16.0, 24.0).view(2, 4) - 20.0,
    }
    order = pruning_order(importance)
    assert order[:2] == [("cross", 0, 0), ("cross", 0, 1)] and order[-1] == ("decoder_self", 1, 3)
    with masked_heads(model, order[:5]):
        masks = {(k, i): a.head_mask for k, i, a in sublayers(model)}
    # The fifth is a tie at 0 between encoder_self 0/0 and cross 1/0: model order decides.
    assert masks[("cross", 0)].tolist() == [0.0] * 4
    assert masks[("encoder_self", 0)].tolist() == [0.0, 1.0, 1.0, 1.0]
    assert masks[("cross", 1)].tolist() == [1.0] * 4
    assert all(a.head_mask is None for *_, a in sublayers(model))
    search = {"length_penalty": 1.0, "max_len_a": 1.0, "max_len_b": 5}
    sources, refs = [s for s, _ in SENTENCES], [t for _, t in SENTENCES]
    rows = pruning_curve(model, tokenizer, sources, refs, order, [0.0, 0.5], search)
    assert [(r["heads_masked"], r["heads_kept"]) for r in rows] == [(0, 24), (12, 12)]
    from multihead.evaluation.metrics import corpus_scores

    with torch.inference_mode():
        plain = translate(model, tokenizer, sources, beam_size=1, **search)
        with masked_heads(model, order[:12]):
            half = translate(model, tokenizer, sources, beam_size=1, **search)
    assert rows[0]["bleu"] == corpus_scores(plain, refs).bleu
    assert rows[1]["bleu"] == corpus_scores(half, refs).bleu
    # Nothing masked: the "pruned" copy is the model itself.
    assert rows[0]["params_pruned"] == rows[0]["params"] == model.num_parameters()
    assert (rows[0]["bleu_pruned"], rows[0]["same_as_masked"]) == (rows[0]["bleu"], len(sources))
    # Half the heads include all four of cross-attention layer 0: not prunable, so no columns.
    assert rows[1]["params_pruned"] is None and rows[1]["same_as_masked"] is None


def test_gqa_groups_are_masked_whole_and_then_prune(tokenizer):
    model = analysis_model(tokenizer.vocab_size)  # decoder self-attention: 2 groups of 2
    importance = {"decoder_self": torch.tensor([[0.1, 5.0, 0.2, 0.3], [0.4, 0.4, 1.0, 0.0]])}
    # Group sums: layer 0 5.1 and 0.5, layer 1 0.8 and 1.0, so layer 0's second group first.
    order = pruning_order(importance, group_size=2)
    assert order[:4] == [("decoder_self", 0, 2), ("decoder_self", 0, 3)] + [
        ("decoder_self", 1, 0),
        ("decoder_self", 1, 1),
    ]
    assert pruning_order(importance) == sorted(
        order, key=lambda h: float(importance["decoder_self"][h[1], h[2]])
    )  # one head at a time: by the heads' own scores
    with pytest.raises(ValueError, match="group_size=3 does not divide the 4 heads"):
        pruning_order(importance, group_size=3)
    with pytest.raises(ValueError, match=r"K/V head differ between sublayers \(\[1, 2, 4\]\)"):
        kv_group_size(model)  # MHA encoder, GQA decoder, MQA cross-attention
    search = {"length_penalty": 1.0, "max_len_a": 1.0, "max_len_b": 5}
    sources, refs = [s for s, _ in SENTENCES], [t for _, t in SENTENCES]
    # 0.3 of 8 heads is 2.4: one group of 2 with unit=2, and 2 heads without it.
    (row,) = pruning_curve(model, tokenizer, sources, refs, order, [0.3], search, unit=2)
    assert row["heads_masked"] == 2 and row["same_as_masked"] == len(sources)
    head_order = pruning_order(importance)  # heads 1/3 and 0/0: two groups split
    (row,) = pruning_curve(model, tokenizer, sources, refs, head_order, [0.3], search)
    assert row["heads_masked"] == 2 and row["params_pruned"] is None


def test_max_similarity_is_each_heads_closest_other_head():
    matrix = torch.tensor([[1.0, 0.2, 0.5], [0.2, 1.0, -0.1], [0.5, -0.1, 1.0]])
    single = torch.ones(1, 1)
    out = max_similarity({"cross": [matrix, matrix.flip(0).flip(1)], "encoder_self": [single]})
    torch.testing.assert_close(out["cross"], torch.tensor([[0.5, 0.2, 0.5], [0.5, 0.2, 0.5]]))
    assert out["encoder_self"].isnan().all()  # one head: no other to compare with


def test_pruning_curve_prunes_the_masked_heads_for_real(tokenizer):
    model = analysis_model(tokenizer.vocab_size)  # E = 16, D = 4; MHA encoder, MQA cross
    order = [("encoder_self", 0, 1), ("cross", 1, 2), ("decoder_self", 0, 0), ("cross", 0, 0)]
    search = {"length_penalty": 1.0, "max_len_a": 1.0, "max_len_b": 5}
    sources, refs = [s for s, _ in SENTENCES], [t for _, t in SENTENCES]
    (row,) = pruning_curve(model, tokenizer, sources, refs, order, [0.5], search, speed_repeats=3)
    assert row["heads_masked"] == 2
    with torch.inference_mode(), masked_heads(model, order[:2]):
        masked = translate(model, tokenizer, sources, beam_size=1, **search)
    assert row["same_as_masked"] == len(sources)
    from multihead.evaluation.metrics import corpus_scores

    assert row["bleu_pruned"] == row["bleu"] == corpus_scores(masked, refs).bleu
    D, E = 4, 16
    query_head, kv_head = 2 * D * E + D, 2 * D * E + 2 * D  # as in the test below
    assert row["params_pruned"] == model.num_parameters() - (query_head + kv_head) - query_head
    assert row["sent_per_s"] > 0 and row["sent_per_s_pruned"] > 0
    assert row["speedup_pruned"] == row["sent_per_s_pruned"] / row["sent_per_s"]
    with pytest.raises(ValueError, match="speed_repeats=0; expected a positive number"):
        pruning_curve(model, tokenizer, sources, refs, order, [0.5], search, speed_repeats=0)


def write_curve(folder, bleus):
    """A pruning.csv as head_importance.py writes it, with the columns the figure reads."""
    folder.mkdir()
    total = len(bleus) - 1
    lines = ["fraction_masked,heads_masked,heads_kept,bleu"]
    lines += [f"{i / total},{i},{total - i},{b}" for i, b in enumerate(bleus)]
    (folder / "pruning.csv").write_text("\n".join(lines) + "\n")


@pytest.mark.slow  # the script and a process; its parts above
def test_head_importance_script_writes_csv_and_figures(smoke_run_dir, multi30k_dir, tmp_path):
    """The script's main in this process; a bad argument ends the real script in one line."""
    ckpt = smoke_run_dir / "checkpoints" / "last.ckpt"
    write_curve(tmp_path / "earlier", [30.0, 20.0])
    out = tmp_path / "out"
    script_main(
        "head_importance.py",
        "head_importance",
        f"ckpt={ckpt}",
        f"out={out}",
        "limit=6",
        "batch_size=3",
        "prune_fractions=[0.0,0.5]",
        "speed_repeats=2",
        f"beside=[{tmp_path / 'earlier'}]",
        f"data.local_dir={multi30k_dir}",
    )
    with open(out / "heads.csv") as f:
        rows = list(csv.DictReader(f))
    kinds = {r["sublayer"] for r in rows}
    assert kinds == {"encoder_self", "decoder_self", "cross"}
    assert {"importance", "confidence", "prev_share", "rare_share", "rare_keys"} <= set(rows[0])
    assert all(-1.0 <= float(r["max_similarity"]) <= 1.0 for r in rows)
    for kind in kinds:  # l2-normalised per sublayer
        for layer in {r["layer"] for r in rows if r["sublayer"] == kind}:
            values = [
                float(r["importance"]) for r in rows if (r["sublayer"], r["layer"]) == (kind, layer)
            ]  # noqa: E501
            assert sum(v * v for v in values) == pytest.approx(1.0, rel=1e-5)
    for name in (
        "importance",
        "confidence",
        "prev_share",
        "rare_share",
        "max_similarity",
        "pruning",
    ):
        assert (out / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
    curve = read_pruning_curve(out)
    assert [r["fraction_masked"] for r in curve] == ["0.0", "0.5"]
    assert curve[1]["heads_masked"] == len(rows) // 2
    assert curve[0]["heads_kept"] == len(rows)
    bad = run_script("head_importance.py", f"ckpt={ckpt}", f"out={out}", "beside=[nowhere]")
    assert_one_error_line(bad, "no pruning curve at nowhere/pruning.csv")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("limit=0", "limit=0; expected a positive number of sentences"),
        ("speed_repeats=0", "speed_repeats=0; expected a positive number of passes"),
        ("prune_by=layers", "prune_by='layers'; expected 'heads' or 'groups'"),
    ],
)
def test_head_importance_script_bad_options(override, message, tmp_path, capsys):
    error = fails_in_one_line(
        script_main, capsys, "head_importance.py", "head_importance", "ckpt=x", "out=y", override
    )
    assert message in error


def test_earlier_curves_are_drawn_beside(tmp_path):
    write_curve(tmp_path / "mha", [40.0, 39.5, 30.0])
    write_curve(tmp_path / "mqa", [38.0, 37.0, 20.0])
    curves = {name: read_pruning_curve(tmp_path / name) for name in ("mha", "mqa")}
    fig = plot_pruning_curve(curves, "t")
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["mha", "mqa"]
    assert list(lines[1].get_xdata()) == [1.0, 0.5, 0.0]  # the fraction of heads kept
    assert list(lines[1].get_ydata()) == [38.0, 37.0, 20.0]
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "pruning.csv").write_text("fraction_masked,bleu\n")
    with pytest.raises(ValueError, match="empty/pruning.csv has no rows"):
        read_pruning_curve(tmp_path / "empty")
    (tmp_path / "empty" / "pruning.csv").write_text("fraction_masked,bleu\n0.0,3\n")
    with pytest.raises(ValueError, match="is not a pruning curve .'heads_kept'."):
        read_pruning_curve(tmp_path / "empty")


def test_a_pruned_model_computes_the_masked_one_with_fewer_parameters(tokenizer):
    # analysis_model: MHA encoder, GQA (2 groups of 2) decoder self-attention, MQA cross.
    model = analysis_model(tokenizer.vocab_size)
    heads = [("encoder_self", 0, 1), ("encoder_self", 0, 3), ("encoder_self", 1, 0)]
    heads += [("decoder_self", 1, 2), ("decoder_self", 1, 3), ("cross", 0, 0), ("cross", 1, 2)]
    pruned = prune_model(model, heads)
    src, tgt_in, _ = next(batches(tokenizer, SENTENCES, 3, "cpu"))
    with torch.no_grad(), masked_heads(model, heads):
        masked = model(src, tgt_in)
    with torch.no_grad():
        torch.testing.assert_close(pruned(src, tgt_in), masked, atol=1e-5, rtol=1e-4)
    D, E = 4, 16
    query_head = 2 * D * E + D  # W^Q rows, W^O columns, the Q bias
    kv_head = 2 * D * E + 2 * D  # W^K and W^V rows, their biases
    removed = 3 * (query_head + kv_head)  # MHA: three heads with their own K/V
    removed += 2 * query_head + kv_head  # GQA: a group of two and its K/V head
    removed += 2 * query_head  # MQA: two query heads; the one K/V head stays
    assert pruned.num_parameters() == model.num_parameters() - removed
    assert pruned.decoder_layers[1].self_attn.num_kv_heads == 1
    with pytest.raises(ValueError, match="GQA prunes whole groups of 2"):
        prune_model(model, [("decoder_self", 0, 0)])
