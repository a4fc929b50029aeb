"""replace_torch_attention: torch's own models compute what they did, with our layer inside."""

import copy
import importlib
from operator import attrgetter

import pytest
import torch
from torch import nn

from multihead import MultiHeadAttention, replace_torch_attention
from multihead.attention import (
    TorchAttentionAdapter,
    from_torch,
    prune_heads,
    restore_torch_attention,
    with_kv_heads,
    with_kv_latent,
)

E, H, B, L, S = 32, 4, 3, 7, 5


def swapped(model: nn.Module) -> nn.Module:
    """A swapped copy; ``model`` keeps its ``nn.MultiheadAttention``s as the reference."""
    return replace_torch_attention(copy.deepcopy(model))


def adapters(model: nn.Module) -> list[TorchAttentionAdapter]:
    return [m for m in model.modules() if isinstance(m, TorchAttentionAdapter)]


def padding(lengths: list[int], max_len: int) -> torch.Tensor:
    """``(len(lengths), max_len)`` bool, True past each length."""
    return torch.arange(max_len)[None, :] >= torch.tensor(lengths)[:, None]


def some_masked(*shape: int) -> torch.Tensor:
    """A random bool mask (True = masked out) that leaves key 0 to every query, so no row
    is fully masked (torch gives NaN there, the layer zeros; see the test at the end)."""
    mask = torch.rand(*shape) < 0.3
    mask[..., 0] = False
    return mask


def seq(x: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """``(B, L, E)`` in the caller's layout."""
    return x if batch_first else x.transpose(0, 1).contiguous()


def import_or_skip(name: str):
    """``name`` imported, or the test skipped where it is missing or cannot load. Both
    packages tried here need torchvision (open_clip depends on it), whose only wheel for
    torch 2.13.0 is a CUDA build, so no extra installs them (torchvision built for another
    torch raises RuntimeError: its operators do not register)."""
    try:
        return importlib.import_module(name)
    except (ImportError, RuntimeError) as error:
        pytest.skip(f"{name} cannot be imported here (it needs torchvision): {error}")


# ------------------------------------------------------------------ nn.MultiheadAttention
MASK_CASES = {
    "none": lambda: {},
    "bool_2d": lambda: {"attn_mask": some_masked(L, L)},
    "float_3d": lambda: {"attn_mask": torch.randn(B * H, L, L)},
    "bool_3d": lambda: {"attn_mask": some_masked(B * H, L, L)},
    "padding_bool": lambda: {"key_padding_mask": padding([L, 4, 2], L)},
    "padding_float": lambda: {
        "key_padding_mask": torch.zeros(B, L).masked_fill(padding([L, 4, 2], L), float("-inf"))
    },
    "padding_and_bool": lambda: {
        "key_padding_mask": padding([L, 4, 2], L),
        "attn_mask": some_masked(L, L),
    },
    "padding_float_and_bool": lambda: {
        "key_padding_mask": torch.zeros(B, L).masked_fill(padding([L, 4, 2], L), float("-inf")),
        "attn_mask": some_masked(L, L),
    },
    "causal_hint": lambda: {
        "attn_mask": nn.Transformer.generate_square_subsequent_mask(L),
        "is_causal": True,
    },
    "causal_hint_padding": lambda: {
        "attn_mask": nn.Transformer.generate_square_subsequent_mask(L),
        "is_causal": True,
        "key_padding_mask": padding([L, 4, 2], L),
    },
}


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("masks", MASK_CASES)
def test_self_attention_matches_torch(masks, average, batch_first) -> None:
    mha = nn.MultiheadAttention(E, H, batch_first=batch_first)
    nn.init.normal_(mha.in_proj_bias)  # non-zero biases, so they are checked too
    adapter = replace_torch_attention(copy.deepcopy(mha))
    assert isinstance(adapter, TorchAttentionAdapter)
    x = seq(torch.randn(B, L, E), batch_first)
    kwargs = MASK_CASES[masks]()
    # torch's need_weights path ignores the is_causal hint and uses attn_mask; both agree.
    for need_weights in (False, True):
        want, want_w = mha(
            x, x, x, need_weights=need_weights, average_attn_weights=average, **kwargs
        )
        got, got_w = adapter(
            x, x, x, need_weights=need_weights, average_attn_weights=average, **kwargs
        )
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        if need_weights:
            assert got_w.shape == want_w.shape  # (B, L, S) or (B, H, L, S)
            torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=0)
        else:
            assert got_w is None and want_w is None


@pytest.mark.parametrize("batch_first", [True, False])
def test_cross_attention_matches_torch(batch_first) -> None:
    mha = nn.MultiheadAttention(E, H, batch_first=batch_first)
    adapter = replace_torch_attention(copy.deepcopy(mha))
    x = seq(torch.randn(B, L, E), batch_first)
    memory = seq(torch.randn(B, S, E), batch_first)
    masks = {"key_padding_mask": padding([S, 3, 1], S), "attn_mask": some_masked(L, S)}
    want, want_w = mha(x, memory, memory, average_attn_weights=False, **masks)
    got, got_w = adapter(x, memory, memory, average_attn_weights=False, **masks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=0)


def test_unbatched_input_matches_torch() -> None:
    mha = nn.MultiheadAttention(E, H)
    adapter = replace_torch_attention(copy.deepcopy(mha))
    x, memory = torch.randn(L, E), torch.randn(S, E)
    kwargs = {"key_padding_mask": padding([3], S)[0], "attn_mask": torch.randn(H, L, S)}
    want, want_w = mha(x, memory, memory, **kwargs)
    got, got_w = adapter(x, memory, memory, **kwargs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------- whole models
def encoder(batch_first: bool) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(
        d_model=E, nhead=H, dim_feedforward=64, dropout=0.0, batch_first=batch_first
    )
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=batch_first)


ENCODER_MASKS = {
    "none": lambda: {},
    "padding": lambda: {"src_key_padding_mask": padding([L, 4, 2], L)},
    "causal": lambda: {"mask": nn.Transformer.generate_square_subsequent_mask(L)},
    "causal_padding": lambda: {
        "mask": nn.Transformer.generate_square_subsequent_mask(L),
        "src_key_padding_mask": padding([L, 4, 2], L),
    },
}


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", ENCODER_MASKS)
def test_transformer_encoder_in_train_mode(masks, batch_first) -> None:
    torch_model = encoder(batch_first).train()
    ours = swapped(torch_model)
    assert len(adapters(ours)) == 2 and not any(
        isinstance(m, nn.MultiheadAttention) for m in ours.modules()
    )
    x = seq(torch.randn(B, L, E), batch_first)
    kwargs = ENCODER_MASKS[masks]()
    want, got = torch_model(x, **kwargs), ours(x, **kwargs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # The same gradients reach the same weights (our in_proj is torch's in_proj_weight).
    want.square().sum().backward()
    got.square().sum().backward()
    for theirs, mine in zip(torch_model.layers, ours.layers, strict=True):
        torch.testing.assert_close(
            mine.self_attn.attn.in_proj.weight.grad, theirs.self_attn.in_proj_weight.grad
        )


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", ENCODER_MASKS)
def test_transformer_encoder_in_eval_mode(masks, batch_first) -> None:
    # Eval mode under no_grad is torch's fast path: the fused encoder-layer kernel, and with
    # a padding mask (batch_first) nested tensors, which leave padded positions at zero.
    torch_model = encoder(batch_first).eval()
    ours = swapped(torch_model)
    x = seq(torch.randn(B, L, E), batch_first)
    kwargs = ENCODER_MASKS[masks]()
    with torch.no_grad():
        want, got = torch_model(x, **kwargs), ours(x, **kwargs)
    keep = torch.ones(B, L, dtype=torch.bool)
    if "src_key_padding_mask" in kwargs:
        keep = ~kwargs["src_key_padding_mask"]
        if batch_first and "mask" not in kwargs:
            assert want[~keep].abs().max() == 0  # torch took the nested-tensor path
    keep = seq(keep[..., None], batch_first)[..., 0]  # in the caller's layout
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=0)


def transformer(batch_first: bool) -> nn.Transformer:
    return nn.Transformer(
        d_model=E,
        nhead=H,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dim_feedforward=64,
        dropout=0.0,
        batch_first=batch_first,
    )


def transformer_inputs(batch_first: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    src, tgt = torch.randn(B, S, E), torch.randn(B, L, E)
    masks = {
        "tgt_mask": nn.Transformer.generate_square_subsequent_mask(L),
        "src_key_padding_mask": padding([S, 3, 2], S),
        "memory_key_padding_mask": padding([S, 3, 2], S),
        "tgt_key_padding_mask": padding([L, 6, 4], L),
    }
    return seq(src, batch_first), seq(tgt, batch_first), masks


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_nn_transformer(mode, batch_first) -> None:
    torch_model = transformer(batch_first).train(mode == "train")
    ours = swapped(torch_model)
    assert len(adapters(ours)) == 2 + 2 * 2  # encoder self; decoder self and cross
    src, tgt, masks = transformer_inputs(batch_first)
    with torch.set_grad_enabled(mode == "train"):
        want, got = torch_model(src, tgt, **masks), ours(src, tgt, **masks)
    # Padded memory positions differ on torch's eval fast path (zeros there), but the
    # decoder never attends to them, so every output position compares.
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_swapped_transformer_converts_to_gqa_and_trains() -> None:
    ours = swapped(transformer(batch_first=True))
    for adapter in adapters(ours):
        adapter.attn = with_kv_heads(adapter.attn, 2)
    assert {a.attn.num_kv_heads for a in adapters(ours)} == {2}
    src, tgt, masks = transformer_inputs(batch_first=True)
    out = ours.train()(src, tgt, **masks)
    out.square().mean().backward()
    for adapter in adapters(ours):
        assert adapter.attn.in_proj.weight.shape == (E + 2 * 2 * (E // H), E)
        assert adapter.attn.in_proj.weight.grad.abs().sum() > 0
    with torch.no_grad():  # eval, where torch's fast path would look for its own weights
        out = ours.eval()(src, tgt, **masks)
    assert out.shape == (B, L, E) and out.isfinite().all()


def test_nested_tensor_fast_path_is_turned_off_only_where_swapped() -> None:
    model = nn.ModuleDict({"ours": encoder(True), "theirs": encoder(True)})
    model["ours"] = replace_torch_attention(model["ours"])
    assert model["ours"].use_nested_tensor is False and model["theirs"].use_nested_tensor


def test_backend_is_passed_on() -> None:
    ours = replace_torch_attention(encoder(True), backend="math")
    assert {a.attn.backend for a in adapters(ours)} == {"math"}


def test_a_shared_module_gets_one_adapter() -> None:
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    model = nn.ModuleDict({"a": mha, "b": nn.Sequential(mha)})
    replace_torch_attention(model)
    assert isinstance(model["a"], TorchAttentionAdapter) and model["b"][0] is model["a"]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"kdim": 16, "vdim": 16}, "kdim=16, vdim=16 differ from embed_dim=32"),
        ({"add_bias_kv": True}, "add_bias_kv=True is not supported"),
        ({"add_zero_attn": True}, "add_zero_attn=True is not supported"),
    ],
)
def test_unsupported_options_name_the_module(options, message) -> None:
    model = nn.Module()
    model.encoder = nn.ModuleList([nn.MultiheadAttention(E, H), nn.MultiheadAttention(E, H)])
    model.encoder[1] = nn.MultiheadAttention(E, H, **options)
    with pytest.raises(ValueError, match=f"cannot replace 'encoder.1': {message}"):
        replace_torch_attention(model)
    assert isinstance(model.encoder[0], nn.MultiheadAttention)  # nothing was replaced


def test_from_torch_layer_is_the_plain_layer() -> None:
    adapter = replace_torch_attention(nn.MultiheadAttention(E, H, dropout=0.1))
    assert type(adapter.attn) is MultiHeadAttention and adapter.attn.dropout == 0.1
    assert adapter.batch_first is False and adapter.training


def test_from_torch_copies_and_refuses_what_the_swap_refuses() -> None:
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    layer = from_torch(mha)
    with torch.no_grad():
        layer.in_proj.weight.zero_(), layer.out_proj.weight.zero_()
    assert mha.in_proj_weight.abs().sum() > 0 and mha.out_proj.weight.abs().sum() > 0
    with pytest.raises(ValueError, match="from_torch cannot convert .*DoubledAttention has its"):
        from_torch(DoubledAttention(E, H))
    with pytest.raises(ValueError, match="from_torch cannot convert .*add_zero_attn=True"):
        from_torch(nn.MultiheadAttention(E, H, add_zero_attn=True))
    with pytest.raises(TypeError, match="expected torch.nn.MultiheadAttention, got Linear"):
        from_torch(nn.Linear(E, E))


def test_fully_masked_rows_are_zeros() -> None:
    mha = nn.MultiheadAttention(E, H, batch_first=True)
    nn.init.normal_(mha.out_proj.bias)
    adapter = replace_torch_attention(copy.deepcopy(mha))
    x = torch.randn(B, L, E)
    mask = torch.zeros(L, L, dtype=torch.bool)
    mask[2] = True  # query 2 may attend to nothing
    rows = torch.arange(L) != 2
    for need_weights in (False, True):
        want, want_w = mha(x, x, x, attn_mask=mask, need_weights=need_weights)
        got, got_w = adapter(x, x, x, attn_mask=mask, need_weights=need_weights)
        # Query 2's attention is zero, so its output is out_proj's bias alone.
        torch.testing.assert_close(got[:, 2], mha.out_proj.bias.expand(B, E))
        torch.testing.assert_close(got[:, rows], want[:, rows], atol=1e-5, rtol=0)
        if need_weights:  # torch's explicit softmax divides 0 by 0
            assert want[:, 2].isnan().all() and want_w[:, 2].isnan().all()
            assert (got_w[:, 2] == 0).all()
        else:  # torch's SDPA path zeros the row too
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# ------------------------------------------------ code written for nn.MultiheadAttention
def test_the_adapter_has_what_torch_code_reads() -> None:
    mha = nn.MultiheadAttention(E, H, dropout=0.1, batch_first=True)
    adapter = replace_torch_attention(copy.deepcopy(mha))
    for name in (
        "embed_dim", "num_heads", "head_dim", "dropout", "batch_first", "kdim", "vdim",
        "bias_k", "bias_v", "add_zero_attn",
    ):  # fmt: skip
        assert getattr(adapter, name) == getattr(mha, name), name
    for name in ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"):
        torch.testing.assert_close(attrgetter(name)(adapter), attrgetter(name)(mha))
    # The layer's own tensors, not copies: what is written to them is written to the layer.
    assert adapter.in_proj_weight is adapter.attn.in_proj.weight
    assert adapter.in_proj_bias is adapter.attn.in_proj.bias
    assert adapter.out_proj is adapter.attn.out_proj
    adapter.attn = with_kv_heads(adapter.attn, 2)  # no longer torch's (3E, E) stack
    assert adapter.in_proj_weight is None and adapter.in_proj_bias is None


def init_as_open_clip(model: nn.Module) -> None:
    """What open_clip's ``TextTransformer.init_parameters`` does to each block's attention."""
    attn_std, proj_std = E**-0.5, E**-0.5 * (2 * 2) ** -0.5
    for block in model.layers:
        nn.init.normal_(block.self_attn.in_proj_weight, std=attn_std)
        nn.init.normal_(block.self_attn.out_proj.weight, std=proj_std)


def test_an_init_written_for_torch_writes_the_layer() -> None:
    torch_model = encoder(batch_first=True).train()
    ours = swapped(torch_model)
    for model in (torch_model, ours):
        torch.manual_seed(1)
        init_as_open_clip(model)
    x = torch.randn(B, L, E)
    torch.testing.assert_close(ours(x), torch_model(x), atol=1e-5, rtol=0)
    for theirs, mine in zip(torch_model.layers, ours.layers, strict=True):
        torch.testing.assert_close(
            mine.self_attn.attn.in_proj.weight, theirs.self_attn.in_proj_weight
        )


def test_open_clip_text_tower_init_parameters() -> None:
    transformer = import_or_skip("open_clip.transformer")
    torch.manual_seed(0)
    theirs = transformer.TextTransformer(
        context_length=8, vocab_size=50, width=E, heads=H, layers=2, output_dim=16
    ).eval()
    ours = swapped(theirs)
    assert len(adapters(ours)) == 2
    for model in (theirs, ours):  # a new seed: the swapped tower must be written again
        torch.manual_seed(1)
        model.init_parameters()
    tokens = torch.randint(1, 50, (B, 8))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens), atol=1e-5, rtol=0)


def test_frozen_attention_stays_frozen() -> None:
    model = encoder(batch_first=True)
    for layer in model.layers:
        layer.self_attn.requires_grad_(False)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    replace_torch_attention(model)
    assert {id(p) for p in model.parameters() if p.requires_grad} == trainable
    assert not any(p.requires_grad for a in adapters(model) for p in a.parameters())


def test_an_optimizer_built_before_the_swap_still_trains_the_attention() -> None:
    torch_model = encoder(batch_first=True).train()
    ours = copy.deepcopy(torch_model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (torch_model, ours)]
    before = torch_model.layers[0].self_attn.in_proj_weight.detach().clone()
    replace_torch_attention(ours)
    x = torch.randn(B, L, E)
    for model, optimizer in zip((torch_model, ours), optimizers, strict=True):
        model(x).square().sum().backward()
        optimizer.step()
    for theirs, mine in zip(torch_model.layers, ours.layers, strict=True):
        torch.testing.assert_close(mine.self_attn.in_proj_weight, theirs.self_attn.in_proj_weight)
        torch.testing.assert_close(mine.self_attn.out_proj.weight, theirs.self_attn.out_proj.weight)
    assert not torch.equal(torch_model.layers[0].self_attn.in_proj_weight, before)


def test_hooks_on_the_old_module_fire_on_the_adapter() -> None:
    model = encoder(batch_first=True).train()
    calls = []
    mha = model.layers[0].self_attn
    pre = mha.register_forward_pre_hook(lambda m, args: calls.append(("pre", len(args))))
    post = mha.register_forward_hook(lambda m, args, out: calls.append(("post", type(m))))
    replace_torch_attention(model)
    x = torch.randn(B, L, E)
    model(x)
    assert calls == [("pre", 3), ("post", TorchAttentionAdapter)]
    pre.remove()  # the handles still reach the hooks
    post.remove()
    model(x)
    assert len(calls) == 2


def test_state_dict_hooks_are_named_in_a_warning() -> None:
    model = encoder(batch_first=True)
    model.layers[1].self_attn.register_load_state_dict_post_hook(lambda module, keys: None)
    with pytest.warns(UserWarning, match="'layers.1.self_attn': its load_state_dict post-hooks"):
        replace_torch_attention(model)


class DoubledAttention(nn.MultiheadAttention):
    def forward(self, query, key, value, **kwargs):
        out, weights = super().forward(query, key, value, **kwargs)
        return 2 * out, weights


class RenamedAttention(nn.MultiheadAttention):
    """A subclass that keeps torch's forward."""


def test_a_subclass_with_its_own_forward_is_refused() -> None:
    model = nn.Module()
    model.blocks = nn.ModuleList([RenamedAttention(E, H), DoubledAttention(E, H)])
    with pytest.raises(
        ValueError, match="cannot replace 'blocks.1': DoubledAttention has its own forward"
    ):
        replace_torch_attention(model)
    assert type(model.blocks[0]) is RenamedAttention  # nothing was replaced
    del model.blocks[1]
    replace_torch_attention(model)
    assert isinstance(model.blocks[0], TorchAttentionAdapter)


class DetrDecoderLayer(nn.Module):
    """DETR's call: positions added to the key, not to the value."""

    def __init__(self) -> None:
        super().__init__()
        self.cross = nn.MultiheadAttention(E, H, batch_first=True)

    def forward(self, x, memory, positions):
        return self.cross(x, memory + positions, memory)[0]


def test_separate_key_and_value_name_the_module() -> None:
    model = nn.Sequential(DetrDecoderLayer())
    replace_torch_attention(model)
    x, memory = torch.randn(B, L, E), torch.randn(B, S, E)
    with pytest.raises(
        ValueError, match="'0.cross' was called with key and value as different tensors"
    ):
        model[0](x, memory, torch.randn(B, S, E))


def test_eval_mode_runs_the_layer_not_torchs_fused_kernel(monkeypatch) -> None:
    # The conditions of nn.TransformerEncoderLayer's fused kernel: batch-first, eval mode, no
    # grad, an even head count, and no hooks (a hook would turn it off: count by patching).
    model = swapped(encoder(batch_first=True).eval())
    calls = []
    forward = MultiHeadAttention.forward
    monkeypatch.setattr(
        MultiHeadAttention,
        "forward",
        lambda self, *a, **k: calls.append(1) or forward(self, *a, **k),
    )
    with torch.no_grad():
        model(torch.randn(B, L, E))
    assert len(calls) == 2


# ------------------------------------------------------------------------------ going back
@pytest.mark.parametrize("batch_first", [True, False])
def test_restore_gives_back_the_model_that_was_swapped(batch_first) -> None:
    model = transformer(batch_first).eval()
    parameters = {name: id(p) for name, p in model.named_parameters()}
    nested = model.encoder.use_nested_tensor
    src, tgt, masks = transformer_inputs(batch_first)
    with torch.no_grad():
        want = model(src, tgt, **masks)
    model = restore_torch_attention(replace_torch_attention(model))
    assert not adapters(model)
    assert sum(type(m) is nn.MultiheadAttention for m in model.modules()) == 6
    assert {name: id(p) for name, p in model.named_parameters()} == parameters
    assert model.encoder.use_nested_tensor == nested
    with torch.no_grad():
        assert torch.equal(model(src, tgt, **masks), want)


def test_a_swapped_models_state_dict_loads_strictly_into_the_original() -> None:
    original = transformer(batch_first=True)
    ours = swapped(original)
    with torch.no_grad():  # as if trained after the swap
        for p in ours.parameters():
            p.add_(0.1 * torch.randn_like(p))
    state = restore_torch_attention(copy.deepcopy(ours)).state_dict()
    original.load_state_dict(state, strict=True)
    src, tgt, masks = transformer_inputs(batch_first=True)
    torch.testing.assert_close(
        original(src, tgt, **masks), ours(src, tgt, **masks), atol=1e-5, rtol=0
    )
    assert adapters(ours)  # the copy was restored, not the model


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: with_kv_heads(a, 2), "its layer has 2 K/V heads for 4 query heads"),
        (lambda a: with_kv_latent(a, 16), "its layer has a head design"),
        (lambda a: prune_heads(a, [0]), r"its in_proj is \(72, 32\), not \(3E, E\)"),
    ],
)
def test_restore_refuses_what_torch_cannot_hold(change, message) -> None:
    model = swapped(encoder(batch_first=True))
    model.layers[1].self_attn.attn = change(model.layers[1].self_attn.attn)
    with pytest.raises(ValueError, match=f"cannot restore 'layers.1.self_attn': {message}"):
        restore_torch_attention(model)
    assert len(adapters(model)) == 2  # nothing was restored


# ---------------------------------------------------------------- a vision transformer
def test_torchvision_vit_b_16() -> None:
    models = import_or_skip("torchvision.models")
    torch.manual_seed(0)
    torch_model = models.vit_b_16().eval()  # random weights
    # The classifier starts at zero (torchvision's init), so compare the CLS features before it.
    torch_model.heads = nn.Identity()
    ours = swapped(torch_model)
    assert len(adapters(ours)) == 12
    broken = swapped(torch_model)  # what the comparison must catch: MQA, random out_proj
    for adapter in adapters(broken):
        adapter.attn = with_kv_heads(adapter.attn, 1)
        nn.init.normal_(adapter.attn.out_proj.weight)
    images = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        want, got, wrong = torch_model(images), ours(images), broken(images)
    assert want.shape == (1, 768) and want.abs().max() > 0.1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (wrong - want).abs().max() > 0.1
