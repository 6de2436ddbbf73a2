"""`families.draft_config`: a draft config's field types and bounds, read from a file's values, refused in one line
that names the field as the file spells it."""

import pytest

from speculators_train.families.draft_config import checked, within
from speculators_train.families.eagle.model import Eagle3Config, LlamaLayer
from speculators_train.families.medusa.model import MedusaConfig
from speculators_train.families.mlp.model import MLPConfig

MEDUSA = {"hidden_size": 576, "num_heads": 3, "num_layers": 1, "draft_vocab_size": 64, "target_vocab_size": 49152}


@pytest.mark.parametrize(
    ("change", "keys", "message"),
    [
        ({"num_heads": 17}, None, "num_heads must be in 1..16, got 17"),
        ({"num_layers": 1.0}, None, "num_layers must be an integer, got 1.0"),
        ({"num_layers": False}, None, "num_layers must be an integer, got false"),
        ({"hidden_size": None}, None, "hidden_size is missing"),  # a null reads as a missing key
        ({"num_layers": 0}, {"num_layers": "num_hidden_layers"}, "num_hidden_layers must be in 1..16, got 0"),
        ({"zeta": 1, "alpha": 2}, None, "unknown keys ['alpha', 'zeta']"),
    ],
)
def test_a_bad_value_is_refused_in_one_line_naming_the_key_as_the_file_spells_it(change, keys, message):
    with pytest.raises(ValueError) as refused:
        checked(MedusaConfig, {**MEDUSA, **change}, keys)
    assert str(refused.value) == message


def test_a_null_field_with_a_default_takes_the_default_and_a_good_config_reads_whole():
    config = checked(MedusaConfig, {**MEDUSA, "target_num_layers": None})
    assert config == MedusaConfig(576, 3, 1, 64, 49152, 0)
    assert checked(MLPConfig, {"emb_dim": 8, "inner_dim": 0, "n_predict": 2, "vocab_size": 10}).inner_dim == 8


def test_bounds_inside_a_type_are_named_an_optional_integer_and_a_list_item():
    layer = {"hidden_size": 8, "intermediate_size": 16, "vocab_size": 10, "num_attention_heads": 2}
    with pytest.raises(ValueError, match=r"^layer\.head_dim must be in 1\.\.65536, got 0$"):
        checked(LlamaLayer, {**layer, "head_dim": 0}, prefix="layer.")
    with pytest.raises(ValueError, match=r"^layer\.rms_norm_eps must be a number above 0, got \"1e-5\"$"):
        checked(LlamaLayer, {**layer, "rms_norm_eps": "1e-5"}, prefix="layer.")
    eagle = {"layer_config": layer, "target_hidden_size": 8, "draft_vocab_size": 4, "aux_layer_ids": [1, 70000]}
    with pytest.raises(ValueError, match=r"^eagle_aux_ids\[1\] must be in 0\.\.4095, got 70000$"):
        checked(Eagle3Config, eagle, {"aux_layer_ids": "eagle_aux_ids"})
    with pytest.raises(ValueError, match=r"^aux_layer_ids \[2, 1\] must be distinct and ascending$"):
        checked(Eagle3Config, {**eagle, "aux_layer_ids": [2, 1]})


def test_a_bound_that_depends_on_another_field_is_refused_in_the_same_words():
    assert within(5, 1, 5, "x") == 5
    with pytest.raises(ValueError, match=r"^draft_vocab_size must be in 1\.\.49152, got 49153$"):
        within(49153, 1, 49152, "draft_vocab_size")
