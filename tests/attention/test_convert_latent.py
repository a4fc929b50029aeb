"""with_kv_latent's factorisations (issue 67): the PCA of the K/V outputs on calibration inputs,
K/V balancing, and one rotary key shared by all heads (TransMLA's RoRoPE with FreqFold), each
against the unconverted layer or a reference written here from the definitions."""

from __future__ import annotations

import re

import pytest
import torch

from multihead import MultiHeadAttention
from multihead.attention import with_kv_latent
from multihead.attention.convert import PCA_DAMPING


def rotary_layer(num_kv_heads, rotary_dim=8, interleaved=False, *, E=32, H=4, seed=0):
    """A rotary layer (E = 32, H = 4, D = 8) in fp64 with every bias drawn."""
    torch.manual_seed(seed)
    layer = MultiHeadAttention(E, H, num_kv_heads, rotary_dim=rotary_dim,
                               rope_interleaved=interleaved, dtype=torch.float64)  # fmt: skip
    with torch.no_grad():
        layer.in_proj.bias.normal_(), layer.out_proj.bias.normal_()
    return layer.eval()


def decodes_as_the_full_pass(layer, x):
    """The layer's output on ``x`` (B, L, E), and the same decoded through its cache."""
    with torch.no_grad():
        full = layer(x, is_causal=True)
        cache = layer.make_kv_cache(x.shape[0], x.shape[1])
        steps = [layer(x[:, :3], is_causal=True, kv_cache=cache)]
        steps += [
            layer(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(3, x.shape[1])
        ]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-10)
    return full, cache


# ---------------------------------------------------------------- exact where nothing is dropped
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize(
    ("num_kv_heads", "rotary_key", "rope_dim"),
    [(4, "per_group", None), (2, "per_group", None), (1, "per_group", None),
     (2, "shared", 16), (4, "shared", 32), (1, "shared", 8)],
    ids=["mha", "gqa", "mqa", "gqa_shared_all", "mha_shared_all", "mqa_shared"],
)  # fmt: skip
@pytest.mark.parametrize("balance_kv", [False, True], ids=["", "bkv"])
def test_calibrated_conversion_at_full_rank_is_the_source_layer_for_any_input(
    num_kv_heads, rotary_key, rope_dim, interleaved, balance_kv
):
    """The calibration inputs lie in a 5-dimensional subspace of E = 32; the reference is the
    source layer's own forward on other inputs, which leave that subspace."""
    source, G = rotary_layer(num_kv_heads, interleaved=interleaved), num_kv_heads
    basis = torch.randn(5, 32, dtype=torch.float64)
    calibration = torch.randn(3, 9, 5, dtype=torch.float64) @ basis  # rank 5 < E
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    kept = 8 if rope_dim is None else rope_dim  # numbers of the rotary key(s), per group or shared
    rank = min(2 * G * 8 - (G * kept if rotary_key == "per_group" else kept), 32)
    mla = with_kv_latent(source, rank, rope_dim=rope_dim, rotary_key=rotary_key,
                         calibration=calibration, factorisation="pca",
                         balance_kv=balance_kv)  # fmt: skip
    with torch.no_grad():
        want = source(x, is_causal=True)
    full, cache = decodes_as_the_full_pass(mla, x)
    torch.testing.assert_close(full, want, rtol=0, atol=1e-10)
    # The cache holds what the layer counts: r + G d_R (per group) or r + d_R (shared).
    cached = rank + (G * kept if rotary_key == "per_group" else kept)
    assert mla.kv_cache_bytes_per_token() == cached * 4
    assert mla.cache_layout.width == cached and cache.nbytes() == 2 * 7 * cached * 8
    # Its head_config builds the same architecture: the state_dict loads and computes the same.
    config = {k: v for k, v in mla.head_config.items() if k != "kind"}
    rebuilt = MultiHeadAttention(32, **config, dtype=torch.float64)
    rebuilt.load_state_dict(mla.state_dict())
    torch.testing.assert_close(rebuilt.eval()(x, is_causal=True), want, rtol=0, atol=1e-10)


# ---------------------------------------------------------------- the PCA and BKV, by definition
def pca_reference(w_k, w_v, x, r, scale=1.0):
    """Outputs projected on the top-r principal directions of the damped outputs: the right
    singular vectors of the outputs of x augmented by sqrt(N d) I (an SVD, not an eigh)."""
    N, E = x.shape
    d = PCA_DAMPING * (x.square().sum() / N / E)
    augmented = torch.cat((x, (N * d).sqrt() * torch.eye(E, dtype=x.dtype)))  # (N + E, E)
    w = torch.cat((w_k / scale, w_v))  # (m, E)
    _, _, vh = torch.linalg.svd(augmented @ w.T, full_matrices=False)
    top = vh[:r].T  # (m, r)
    projected = top @ top.T @ w  # (m, E): the rows the latent gives back
    return projected[: len(w_k)] * scale, projected[len(w_k) :]


@pytest.mark.parametrize("balance_kv", [False, True], ids=["pca", "pca_bkv"])
def test_the_latent_is_the_projection_on_the_outputs_principal_directions(balance_kv):
    torch.manual_seed(1)
    layer = MultiHeadAttention(32, 4, 2, dtype=torch.float64)  # GQA, no rotary: K and V whole
    with torch.no_grad():
        layer.in_proj.blocks()[1].mul_(3)  # K outweighs V, as trained K does
    x = torch.randn(4, 16, 32, dtype=torch.float64) @ torch.randn(32, 32, dtype=torch.float64)
    mla = with_kv_latent(layer, 10, calibration=x, factorisation="pca", balance_kv=balance_kv)
    _, w_k, w_v = (w.detach() for w in layer.in_proj.blocks())
    rows = x.reshape(-1, 32)
    # BKV's scale: the RMS of K's outputs over V's, on the (damped) calibration inputs.
    d = PCA_DAMPING * rows.square().sum() / rows.numel()
    rms = [((rows @ w.T).square().mean() + d * w.square().sum(1).mean()).sqrt() for w in (w_k, w_v)]
    scale = (rms[0] / rms[1]).item() if balance_kv else 1.0
    assert not balance_kv or scale > 2  # the balancing has something to do
    want_k, want_v = pca_reference(w_k, w_v, rows, 10, scale)
    # The layer's K/V rows, W_U W_DKV, per query head: GQA's groups are heads 0 and 2.
    up_k, up_v = mla.kv_latent.up.weight.detach().chunk(2)
    down = mla.kv_latent.down.weight.detach()
    torch.testing.assert_close((up_k @ down).view(4, 8, 32)[::2].reshape(16, 32), want_k)
    torch.testing.assert_close((up_v @ down).view(4, 8, 32)[::2].reshape(16, 32), want_v)
    torch.testing.assert_close(down.norm(dim=1), torch.ones(10, dtype=torch.float64))


def outputs_near_a_subspace(n, generator, basis, noise=0.05, length=16):
    """Inputs z A + noise: z of the basis's few dimensions."""
    z = torch.randn(n, length, basis.shape[0], generator=generator, dtype=torch.float64)
    return z @ basis + noise * torch.randn(n, length, basis.shape[1], generator=generator,
                                           dtype=torch.float64)  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_calibrated_conversion_has_at_most_0_8_of_the_weight_only_error_held_out(seed):
    """The check from outside: a rotary MHA layer (E = 64, 4 heads of 16, all rotary) whose K
    weights are 3x V's, inputs near a 6-dimensional subspace (plus noise). At 1/8 of its
    cache (16 numbers a token: 4 groups x 2 rotary features + a latent of 8), the calibrated
    conversion (the PCA, asked for) has an output error on held-out inputs of the same
    distribution at most 0.8 of
    the weight-only conversion's, and so are its K and V errors; at full rank it is exact.
    The reference is the unconverted layer's output."""
    torch.manual_seed(seed)
    source = MultiHeadAttention(64, 4, rotary_dim=16, dtype=torch.float64).eval()
    with torch.no_grad():
        source.in_proj.blocks()[1].mul_(3)
    generator = torch.Generator().manual_seed(100 + seed)
    basis = torch.randn(6, 64, generator=generator, dtype=torch.float64)
    calibration = outputs_near_a_subspace(32, generator, basis)
    held_out = outputs_near_a_subspace(32, generator, basis)
    eighth = with_kv_latent(source, 8, rope_dim=2)  # weights only
    assert source.kv_cache_bytes_per_token() == 8 * eighth.kv_cache_bytes_per_token()

    def errors(mla):
        """Relative errors of the output, and of K (its latent part) and V, held out."""
        with torch.no_grad():
            want = source(held_out, is_causal=True)
            out = ((mla(held_out, is_causal=True) - want).norm() / want.norm()).item()
            _, w_k, w_v = source.in_proj.blocks()
            k, v = held_out @ w_k.T, held_out @ w_v.T  # (B, S, 64), heads side by side
            k_lat, v_lat = mla.kv_latent.expand(mla.kv_latent.latent(held_out))  # (B, H, S, .)
            rest = [i for i in range(16) if i not in (0, 8)]  # "high": pair 0 rotates, kept
            k = k.unflatten(-1, (4, 16))[..., rest].transpose(1, 2)  # (B, H, S, 14)
            v = v.unflatten(-1, (4, 16)).transpose(1, 2)  # (B, H, S, 16)
        rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
        return out, rel(k_lat, k), rel(v_lat, v)

    weights = errors(eighth)
    calibrated = errors(with_kv_latent(source, 8, rope_dim=2, calibration=calibration,
                                       factorisation="pca"))  # fmt: skip
    print(f"seed {seed}: weight-only (out, K, V) {weights}, calibrated {calibrated}")
    assert calibrated[0] <= 0.8 * weights[0]
    assert calibrated[1] <= 0.8 * weights[1] and calibrated[2] <= 0.8 * weights[2]
    exact = with_kv_latent(source, 64, rope_dim=16, calibration=calibration, factorisation="pca")
    with torch.no_grad():
        want = source(held_out, is_causal=True)
        assert ((exact(held_out, is_causal=True) - want).norm() / want.norm()).item() < 1e-12


def test_the_layer_function_builds_what_it_is_told_and_refuses_calibration_it_would_ignore():
    """with_kv_latent chooses nothing (convert_attention measures): its default is the weights'
    SVD, the same layer as factorisation="svd" named; calibration that neither the PCA nor
    selection="norm" reads is refused, not dropped."""
    layer = rotary_layer(2, rotary_dim=8)
    x = torch.randn(4, 8, 32, dtype=torch.float64)
    default, svd = (with_kv_latent(layer, 6, rope_dim=4, **f).kv_latent.down.weight
                    for f in ({}, {"factorisation": "svd"}))  # fmt: skip
    assert torch.equal(default, svd)
    pca = with_kv_latent(layer, 6, rope_dim=4, factorisation="pca", calibration=x)
    assert not torch.allclose(pca.kv_latent.down.weight, svd)
    with pytest.raises(ValueError, match=r"^calibration would be ignored: factorisation='svd' re"):
        with_kv_latent(layer, 6, rope_dim=4, calibration=x)
    with_kv_latent(layer, 6, rope_dim=4, selection="norm", calibration=x)  # "norm" reads it


# ------------------------------------------------------------------ the shared rotary key
def test_the_shared_key_is_each_pairs_top_principal_component_across_the_groups():
    """freqfold 1, one component a pair: for pair i the key is u_i^T k_i, u_i the top
    eigenvector of the G x G second moment of the groups' pair-i components over tokens and
    both coordinates, written here from the outputs; the queries absorb u_i."""
    G, D = 4, 8
    source = rotary_layer(G, rotary_dim=8)
    x = torch.randn(6, 10, 32, dtype=torch.float64)
    mla = with_kv_latent(
        source, 16, rope_dim=8, rotary_key="shared", calibration=x, factorisation="pca"
    )  # the mix weighed by the inputs
    # a digest of what differs from a fresh MLA's defaults: the source's scale 1/sqrt(D)
    assert re.fullmatch(r"mla4r16rope8-[0-9a-f]{6}", mla.head_tag), mla.head_tag
    assert mla.kv_latent.rope_kv_heads == 1 and "softmax_scale" in mla.head_config
    rows = x.reshape(-1, 32)
    _, w_k, _ = (w.detach() for w in source.in_proj.blocks())
    k = (rows @ w_k.T).view(-1, G, D)  # (N, G, D), "rotate half": pair i is features i, i + 4
    d = PCA_DAMPING * rows.square().sum() / rows.numel()
    key = (rows @ mla.kv_latent.k_rope.weight.detach().T).view(-1, 2, 4)  # (N, a/b, pair)
    for i in range(4):
        comps = k[:, :, [i, i + 4]]  # (N, G, 2)
        moment = torch.einsum("ngt,nht->gh", comps, comps) / len(rows)
        w_i = w_k.view(G, D, 32)[:, [i, i + 4]]  # (G, 2, E): the damping's share
        moment = moment + d * torch.einsum("gte,hte->gh", w_i, w_i)
        u = torch.linalg.eigh(moment).eigenvectors[:, -1]  # (G,) top
        want = torch.einsum("g,ngt->nt", u, comps)  # (N, 2)
        sign = torch.sign((want * key[:, :, i]).sum())
        torch.testing.assert_close(key[:, :, i], sign * want)
    # Frequencies: each key pair turns as the source's pair i.
    (kept,) = mla.kv_latent.rope.inv_freq
    assert kept == pytest.approx([10000.0 ** (-i / 4) for i in range(4)], rel=1e-14)


@pytest.mark.parametrize(
    ("rope_dim", "freqfold", "pairs"),
    [(16, None, [0, 1, 2, 3, 4, 5, 6, 7]),  # one component a pair
     (8, None, [0, 2, 4, 6]),  # fold 2: one component a block, the block's first pair
     (8, 4, [0, 2, 4, 6]),  # fold 4, two components a block: pairs 0 and 2 of each block
     (4, None, [0, 4]),  # fold 4, one a block
     (32, 1, [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7])],  # two components a pair
    ids=["fold1", "fold2", "fold4x2", "fold4", "two_a_pair"],
)  # fmt: skip
def test_freqfold_turns_each_kept_component_at_its_blocks_frequencies(rope_dim, freqfold, pairs):
    source = rotary_layer(2, rotary_dim=16, E=64)  # D = 16, 8 pairs
    mla = with_kv_latent(source, 8, rope_dim=rope_dim, rotary_key="shared", freqfold=freqfold)
    freqs = 10000.0 ** (-torch.arange(8, dtype=torch.float64) / 8)
    (kept,) = mla.kv_latent.rope.inv_freq
    assert kept == pytest.approx(freqs[pairs].tolist(), rel=1e-14)
    assert mla.kv_cache_bytes_per_token() == (8 + rope_dim) * 4


def test_the_shared_keys_approximation_costs_less_as_it_keeps_more():
    """Not exact when components are dropped (their pairs stop turning): the output error
    falls as the key keeps more of them, to 0 when it keeps all, at the same full latent."""
    source = rotary_layer(4, rotary_dim=8)
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    with torch.no_grad():
        want = source(x, is_causal=True)
    errors = []
    for rope_dim in (2, 8, 16, 32):
        mla = with_kv_latent(source, min(64 - rope_dim, 32), rope_dim=rope_dim,
                             rotary_key="shared", calibration=x, factorisation="pca")  # fmt: skip
        with torch.no_grad():
            errors.append(((mla(x, is_causal=True) - want).norm() / want.norm()).item())
    assert errors[0] > errors[1] > errors[2] > 1e-3 and errors[3] < 1e-10


# ------------------------------------------------------------------------ refusals, each named
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"calibration": torch.randint(0, 9, (2, 5, 32))}, TypeError,
         "calibration must be the layer's inputs, floats (B, S, 32); got torch.int64"),
        ({"calibration": torch.randn(2, 5, 16)}, ValueError,
         "calibration of 'gqa4kv2-rope' must be (B, S, 32), its inputs; got shape (2, 5, 16)"),
        ({"calibration": torch.randn(0, 5, 32)}, ValueError,
         "calibration is empty (shape (0, 5, 32))"),
        ({"calibration": torch.full((1, 2, 32), float("nan"))}, ValueError,
         "calibration holds NaN or infinite values"),
        ({"calibration": [torch.randn(2, 5, 32)]}, TypeError, "got list"),
        ({"factorisation": "pca"}, ValueError, "factorisation='pca' needs calibration"),
        ({"factorisation": "qr"}, ValueError, "factorisation must be 'svd' or 'pca', got 'qr'"),
        ({"rotary_key": "group"}, ValueError,
         "rotary_key must be 'per_group' or 'shared', got 'group'"),
        ({"rotary_key": "shared", "selection": "norm"}, ValueError,
         "selection='norm' chooses per-group keys' pairs; a shared key keeps the top"),
        ({"freqfold": 2}, ValueError, "freqfold=2 folds the frequencies of rotary_key='shared'"),
        ({"rotary_key": "shared", "rope_dim": 4, "freqfold": 3}, ValueError,
         "freqfold must divide the 4 rotary pairs of 'gqa4kv2-rope' into blocks that each keep"),
        ({"rotary_key": "shared", "rope_dim": 4, "freqfold": 1}, ValueError, "got 1"),
        ({"rotary_key": "shared", "rope_dim": 18}, ValueError,
         "rope_dim of 'gqa4kv2-rope' must be an even number in [2, 16], whole pairs, got 18"),
        ({"rotary_key": "shared", "kv_latent_dim": 25}, ValueError,
         "rank 24 of the K/V stack of 'gqa4kv2-rope' (E = 32, 2GD - rope_dim = 24)"),
        ({"balance_kv": 1}, TypeError, "balance_kv must be a bool, got 1"),
        ({"kv_latent_dim": 16.5}, TypeError, "kv_latent_dim must be an integer, got 16.5"),
        ({"kv_latent_dim": 0}, ValueError, "kv_latent_dim must be >= 1, got 0"),
    ],
    ids=["int_calibration", "width", "empty", "nan", "list", "pca_alone", "factorisation",
         "rotary_key", "shared_selection", "fold_per_group", "fold_blocks", "fold_whole",
         "shared_wide", "shared_rank", "bkv_bool", "rank_float", "rank_zero"],
)  # fmt: skip
def test_bad_latent_options_and_calibration_are_named(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        with_kv_latent(rotary_layer(2), **({"kv_latent_dim": 8} | kwargs))
    with pytest.raises(ValueError, match="rotary_key='shared' needs a rotary layer; 'mha4' has"):
        with_kv_latent(MultiHeadAttention(32, 4), 8, rotary_key="shared")
