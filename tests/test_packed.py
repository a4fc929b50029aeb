"""PackedLinear: nn.Linear's map on a oneDNN copy of the weight, never a stale copy."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from multihead.packed import PackedLinear, can_pack, pack_linears, unpack_linears

pytestmark = pytest.mark.skipif(
    not can_pack(torch.empty(1)), reason="oneDNN is not available in this torch build"
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 50, bias=False))


def test_pack_keeps_parameters_and_state_dict_and_computes_the_linear_map():
    model = _model().eval()
    params = [id(p) for p in model.parameters()]
    keys = list(model.state_dict())
    x = torch.randn(8, 3, 16, dtype=torch.float64).float()
    want = F.linear(F.relu(F.linear(x, model[0].weight, model[0].bias)), model[2].weight)
    assert pack_linears(model) == ["0", "2"]
    assert [id(p) for p in model.parameters()] == params and list(model.state_dict()) == keys
    with torch.inference_mode():
        got = model(x)
    assert model[0]._packed is not None  # the oneDNN path ran
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert unpack_linears(model) == ["0", "2"]
    assert type(model[0]) is nn.Linear and "_packed" not in vars(model[0])


@pytest.mark.parametrize(
    "optimiser", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad]
)
def test_a_fused_optimiser_step_is_seen_by_the_next_inference_call(optimiser):
    """A fused step writes the weight without moving its version counter. With an inference
    call between ``backward()`` and ``step()`` (the copy made from the weight the step then
    changes), the next call computes what a never-packed twin trained alike computes (it was
    0.64-0.96 off before)."""
    model, twin = _model().eval(), _model().eval()
    pack_linears(model)
    steps = [optimiser(m.parameters(), lr=0.1, fused=True) for m in (model, twin)]
    x = torch.randn(4, 16)
    for _ in range(3):
        for m, step in zip((model, twin), steps, strict=True):
            m(x).square().sum().backward()  # nn.Linear's path: gradients flow
            with torch.no_grad():
                m(x)  # makes the copy
            step.step()
            step.zero_grad()
        assert torch.equal(model[0].weight, twin[0].weight)  # the same training
        with torch.no_grad():
            got, want = model(x), twin(x)
        assert model[0]._packed is not None  # the oneDNN path ran
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_load_state_dict_under_no_grad_is_seen_by_the_copy():
    model = _model().eval()
    pack_linears(model)
    x = torch.randn(4, 16)
    with torch.no_grad():
        model(x)  # makes the copies
        other = _model()
        for p in other.parameters():
            p.mul_(3.0)
        model.load_state_dict(other.state_dict())
        torch.testing.assert_close(model(x), other(x), rtol=1e-5, atol=1e-5)


def test_training_mode_and_other_dtypes_run_f_linear():
    layer = nn.Linear(8, 4)
    pack_linears(layer)
    assert isinstance(layer, PackedLinear)
    with torch.no_grad():
        layer(torch.randn(2, 8))  # training mode: F.linear, no copy
        assert layer._packed is None
        layer.eval()(torch.randn(2, 8, dtype=torch.float64).float())
        assert layer._packed is not None
        out = layer.double()(torch.randn(2, 8, dtype=torch.float64))  # fp64: F.linear
    assert out.dtype == torch.float64


def test_a_used_model_deep_copies_and_pickles_without_its_onednn_copy():
    import copy
    import io

    model = _model().eval()
    pack_linears(model)
    x = torch.randn(4, 16)
    with torch.no_grad():
        want = model(x)  # makes the copies
    clone = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (clone, loaded):
        assert other[0]._packed is None
        with torch.no_grad():
            torch.testing.assert_close(other(x), want)


def _reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(F.relu(F.linear(x, model[0].weight, model[0].bias)), model[2].weight)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: [p.data.mul_(3.0) for p in m.parameters()] and m.eval(),  # the documented call
        lambda m: [setattr(p, "data", p.data * 3.0) for p in m.parameters()],
        lambda m: m.load_state_dict({k: v * 3.0 for k, v in m.state_dict().items()}, assign=True),
        lambda m: m.to(torch.bfloat16).float(),  # the new weight may land at the old address
    ],
    ids=["data.mul_-then-eval", "data=", "assign", "bf16-float"],
)
def test_the_copy_follows_its_parameter(change):
    model = _model().eval()
    pack_linears(model)
    x = torch.randn(4, 16)
    with torch.no_grad():
        model(x)  # makes the copies
        change(model)
        torch.testing.assert_close(model(x), _reference(model, x), rtol=1e-5, atol=1e-5)


def test_under_cpu_autocast_the_layer_computes_as_nn_linear_there():
    model = _model().eval()
    reference = _model().eval()
    pack_linears(model)
    x = torch.randn(4, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
        got, want = model(x), reference(x)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
