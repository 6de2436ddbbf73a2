"""The unit tier: pure functions, parsers and schemas, the whole tier in under two minutes. A test here that loads a
model's weights (the session target or any other) fails with the tier it belongs in, rather than slowing the tier."""

from __future__ import annotations

import pytest
import transformers


@pytest.fixture(autouse=True)
def no_model_weights(monkeypatch):
    def refuse(cls, *args, **kwargs):
        raise AssertionError(
            f"a unit test loads no model ({cls.__name__}.from_pretrained): move it to tests/integration or tests/e2e"
        )

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))
