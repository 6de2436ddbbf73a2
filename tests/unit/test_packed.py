"""Linear weights packed for oneDNN: the same linear maps for any row count, undone on exit."""

import pytest
import torch
from torch import nn

from speculators_train.packed import available, packed_linears

pytestmark = pytest.mark.skipif(not available(nn.Linear(2, 2)), reason="needs a CPU torch built with oneDNN")


def test_packed_weights_give_the_same_outputs_for_every_row_count(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32, bias=False))
    inputs = [torch.randn(1, 6, 64), torch.randn(3, 64), torch.randn(1, 1, 64), torch.randn(2, 150, 64)]
    with torch.no_grad():
        want = [model(x) for x in inputs]
    calls = []
    linear = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[0].shape) or linear(*a))
    with torch.no_grad(), packed_linears([model], 6) as packed:
        assert packed
        got = [model(x) for x in inputs]
    assert calls[:2] == [(6, 64), (6, 96)] and len(calls) == 2 * len(inputs)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_training_bf16_and_exit_leave_the_model_as_it_was():
    model = nn.Linear(8, 4)
    x = torch.randn(5, 8)
    with packed_linears([model], 5):
        assert "forward" in model.__dict__
        out = model(x)  # grad enabled: the packed copy would not follow a weight update
        out.sum().backward()
        assert model.weight.grad is not None
    assert "forward" not in model.__dict__
    with packed_linears([model.to(torch.bfloat16)], 5) as packed:
        assert not packed and "forward" not in model.__dict__
    with packed_linears([], 5) as packed:
        assert not packed


def test_nested_blocks_and_foreign_forwards_survive_the_exit():
    outer_model, hooked = nn.Linear(8, 4), nn.Linear(8, 4)
    hook = hooked.forward
    hooked.forward = hook  # what accelerate's hooks do: an instance attribute
    with packed_linears([outer_model, hooked], 5):
        packed_forward = outer_model.__dict__["forward"]
        assert hooked.__dict__["forward"] is hook
        with packed_linears([outer_model, outer_model], 5):
            assert outer_model.__dict__["forward"] is packed_forward
        assert outer_model.__dict__["forward"] is packed_forward
    assert "forward" not in outer_model.__dict__ and hooked.__dict__["forward"] is hook


class Residual(nn.Linear):
    """A Linear whose map is more than its weights, as Medusa's residual blocks are."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.silu(super().forward(x))


def test_a_linear_subclass_with_its_own_forward_keeps_its_map():
    torch.manual_seed(0)
    model = nn.Sequential(Residual(16, 16), nn.Linear(16, 8))
    x = torch.randn(3, 16)
    with torch.no_grad():
        want = model(x)
        with packed_linears([model], 3):
            assert "forward" not in model[0].__dict__ and "forward" in model[1].__dict__
            got = model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
