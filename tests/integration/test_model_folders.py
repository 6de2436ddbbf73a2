"""Model folders a user names from elsewhere (`draft.start`, `data.regenerate.model`, the target) pass one gate
(`speculators_train.folders`) before transformers or vLLM reads them: no custom code, safetensors only, a config a
model runs with; and a target that computes NaN anyway is refused before its states are stored."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from speculators_train.folders import check_model_folder, config_problem
from speculators_train.origin import resolve_origin
from tests.conftest import SHAREGPT, make_recipe, tiny_config
from tests.faults import clean_error
from tests.targets import BY_NAME, build

SOURCES = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}]


def folder(tmp_path: Path, config: dict | None = None, tokenizer: dict | None = None, weights: str = "safetensors"):
    """A model folder with the default target's config and tokenizer (keys changed by `config`, `tokenizer`) and
    weights of the kind named: `safetensors` (the real file, linked), `pickle` (a `pytorch_model.bin` alone),
    `index-to-pickle` (a safetensors index whose weight map names that pickle)."""
    real = Path(resolve_origin(tiny_config())[0])
    out = tmp_path / "elsewhere"
    out.mkdir()
    for name, changes in (("config.json", config), ("tokenizer_config.json", tokenizer)):
        (out / name).write_text(json.dumps({**json.loads((real / name).read_text()), **(changes or {})}))
    shutil.copy(real / "tokenizer.json", out / "tokenizer.json")
    if weights == "safetensors":
        (out / "model.safetensors").symlink_to(real / "model.safetensors")
    else:
        (out / "pytorch_model.bin").write_bytes(b"\x80\x02 a pickle that runs code when loaded")
    if weights == "index-to-pickle":
        index = {"weight_map": {"model.embed_tokens.weight": "pytorch_model.bin"}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "mine.py").write_text("raise SystemExit('custom code ran')\n")
    return out


CUSTOM_CONFIG = {"model_type": "mine", "auto_map": {"AutoConfig": "mine.Config", "AutoModelForCausalLM": "mine.LM"}}
CUSTOM_TOKENIZER = {"tokenizer_class": "MineTokenizer", "auto_map": {"AutoTokenizer": ["mine.Tok", None]}}
FOLDERS = {
    "custom-config": ({"config": CUSTOM_CONFIG}, ("loads only through its own code", "model_type 'mine'")),
    "custom-tokenizer": ({"tokenizer": CUSTOM_TOKENIZER}, ("tokenizer_class 'MineTokenizer'", "never runs")),
    "pickle-only": ({"weights": "pickle"}, ("holds only pickled weights (pytorch_model.bin)", "vLLM alike")),
    "zero-rope-theta": (
        {"config": {"rope_parameters": {"rope_type": "default", "rope_theta": 0}}},
        ("rope_parameters.rope_theta is 0; it must be above 0",),
    ),
    "negative-norm-eps": ({"config": {"rms_norm_eps": -1.0}}, ("rms_norm_eps is -1.0",)),
    "index-to-pickle": (
        {"weights": "index-to-pickle"},
        ("weight_map['model.embed_tokens.weight'] is 'pytorch_model.bin'", "never loaded"),
    ),
    "longrope-zeros": (  # zero factors verify "identical" with AL 4.00: every position collapses
        {
            "config": {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "long_factor": [0.0] * 16,
                    "short_factor": [1.0] * 16,
                    "original_max_position_embeddings": 64,
                }
            }
        },
        ("rope_parameters.long_factor holds 0.0; every factor must be a finite number above 0",),
    ),
    "4096-layers": (  # within the size bounds, but a model its 8 layers of weights do not back
        {"config": {"num_hidden_layers": 4096, "intermediate_size": 1 << 14}},
        ("describes a model of about", "the config is not the weights'"),
    ),
}


@pytest.mark.parametrize("case", list(FOLDERS), ids=list(FOLDERS))
@pytest.mark.parametrize("key", ["draft.start", "data.regenerate.model"])
def test_a_folder_from_elsewhere_is_refused_when_the_recipe_loads(tmp_path, capsys, case, key):
    """Refused by `data` already (the recipe's check), so no stage reaches transformers' prompt to run the folder's
    code, its unpickler, or vLLM's."""
    made, needles = FOLDERS[case]
    path = folder(tmp_path, **made)
    if key == "draft.start":
        recipe = make_recipe(tmp_path / "r", SOURCES, draft={"family": "draft_model", "start": str(path)})
    else:
        regenerate = {"enabled": True, "engine": "vllm", "model": str(path)}
        recipe = make_recipe(tmp_path / "r", SOURCES, data={"regenerate": regenerate})
    clean_error(["data", recipe], capsys, f"{key}: {path}", *needles)


def test_a_folder_whose_auto_map_repeats_shipped_classes_loads_them_without_its_code(tmp_path):
    """Phi-3's hub folders name their own copies of classes transformers ships: with trust_remote_code=False those
    load as transformers' own, and the folder's code is never imported."""
    from transformers import AutoConfig

    path = folder(tmp_path, config={"auto_map": CUSTOM_CONFIG["auto_map"]})
    check_model_folder(path, "draft.start")
    assert AutoConfig.from_pretrained(path, trust_remote_code=False).model_type == "llama"


def test_config_problem_reads_nested_sections_and_leaves_released_values_alone():
    assert config_problem({"text_config": {"rope_parameters": {"full_attention": {"rope_theta": -1}}}}) == (
        "text_config.rope_parameters.full_attention.rope_theta is -1; it must be above 0 (a model with it computes "
        "NaN or collapses positions)"
    )
    assert config_problem({"rope_scaling": {"rope_type": "yarn", "factor": 0.0}}).startswith("rope_scaling.factor")
    assert config_problem({"layer_norm_eps": float("inf")}) == "layer_norm_eps is inf, not a finite number"
    assert config_problem({"hidden_size": 2.5}).startswith("hidden_size is 2.5; it must be an integer")
    released = {
        "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32, "beta_slow": 1, "mscale": 0},
        "rms_norm_eps": 1e-6, "head_dim": None, "max_position_embeddings": 10_485_760, "vocab_size": 262_208,
    }  # fmt: skip
    assert config_problem(released) is None
    longrope = {"rope_type": "longrope", "long_factor": [1.0, 1.5], "short_factor": [1.0, 1.0]}
    assert config_problem({"rope_parameters": longrope}) is None
    for bad in ([1.0, -2.0], [1.0, "x"], []):
        assert config_problem({"rope_parameters": {**longrope, "short_factor": bad}}).startswith(
            "rope_parameters.short_factor holds"
        )


def test_a_target_that_computes_nan_is_refused_before_its_states_are_stored(tmp_path, capsys):
    """A NaN in one norm weight (a damaged checkpoint that still loads): every state after it is NaN, and `generate`
    refuses instead of writing a complete, valid-looking set."""
    target = build(BY_NAME["qwen2.5"], tmp_path / "target")
    weights = load_file(target / "model.safetensors")
    weights["model.layers.3.input_layernorm.weight"][0] = float("nan")
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    recipe = make_recipe(tmp_path / "r", SOURCES, target={"name_or_path": str(target), "aux_layer_ids": [2, 4, 6]})
    clean_error(["generate", recipe], capsys, f"target {target}", "holds NaN or inf", "nothing is stored")
    assert not (tmp_path / "r" / "run" / "hidden_states" / "manifest.json").exists()
