"""The draft model's saved config (`model_config`) for targets whose config derives values or holds infinities:
it must be strict JSON and read back as the same LM config."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from speculators_train.errors import UserError
from speculators_train.families.draft_model.family import cut_layers
from speculators_train.families.draft_model.model import model_config
from speculators_train.files import to_json


def test_a_nemotron_h_draft_config_writes_its_layer_count_and_reads_back_with_its_default_infinity():
    """Nemotron-H derives `num_hidden_layers` from its per-layer list (absent from its dict) and defaults
    `time_step_limit` to (0, inf), which strict JSON would write as null and the class then refuses."""
    target = AutoConfig.for_model("nemotron_h", layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"])
    values = model_config(cut_layers(target, [1, 2]))
    assert values["num_hidden_layers"] == 2 and "time_step_limit" not in values
    read = dict(json.loads(to_json(values)))
    back = AutoConfig.for_model(read.pop("model_type"), **read)
    assert back.layers_block_type == ["mlp", "full_attention"] and back.time_step_limit == target.time_step_limit


def test_an_infinity_the_class_does_not_default_to_is_refused_by_name():
    config = AutoConfig.for_model("nemotron_h", time_step_limit=(0.5, float("inf")))
    with pytest.raises(UserError, match="sets time_step_limit to"):
        model_config(config)
