"""Weights packed for the verify width: the same linear maps, only for that row count, undone on exit."""

import pytest
import torch
from torch import nn

from speculators_train.verify.packed import available, packed_linears

pytestmark = pytest.mark.skipif(not available(nn.Linear(2, 2)), reason="needs a CPU torch built with MKL")


def test_packed_rows_give_the_same_outputs_and_other_rows_the_default_kernel(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32, bias=False))
    x6, x3 = torch.randn(1, 6, 64), torch.randn(3, 64)
    with torch.no_grad():
        want6, want3 = model(x6), model(x3)
    calls = []
    mkl_linear = torch.ops.mkl._mkl_linear
    monkeypatch.setattr(torch.ops.mkl, "_mkl_linear", lambda *a: calls.append(a[0].shape) or mkl_linear(*a))
    with torch.no_grad(), packed_linears(model, [6]) as packed:
        assert packed
        got6 = model(x6)
        assert len(calls) == 2 and calls[0] == (6, 64)
        got3 = model(x3)
        assert len(calls) == 2, "3 rows must keep the default kernel"
    torch.testing.assert_close(got6, want6, rtol=1e-5, atol=1e-5)
    assert torch.equal(got3, want3)
    assert got6.shape == (1, 6, 32)


def test_training_bf16_and_exit_leave_the_model_as_it_was():
    model = nn.Linear(8, 4)
    x = torch.randn(5, 8)
    with packed_linears(model, [5]):
        assert "forward" in model.__dict__
        out = model(x)  # grad enabled: the packed copy would not follow a weight update
        out.sum().backward()
        assert model.weight.grad is not None
    assert "forward" not in model.__dict__
    with packed_linears(model.to(torch.bfloat16), [5]) as packed:
        assert not packed and "forward" not in model.__dict__
    with packed_linears(model.float(), []) as packed:
        assert not packed
