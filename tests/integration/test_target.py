"""Target loading and the layer-id convention, on the session target (the embedded default's architecture, tiny),
and the embedded default SmolLM2 itself where the GGUF it ships is the subject."""

import os

import pytest
import torch

from speculators_train.errors import UserError
from speculators_train.origin import NAMED_TARGETS, _package_dir, resolve_origin
from speculators_train.recipe import TargetConfig
from speculators_train.target import default_aux_layer_ids, load_target
from tests.conftest import tiny_config


def test_exposes_shape_template_and_default_ids(target):
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (8, 128, 49152)
    assert target.aux_layer_ids == [2, 4, 5]
    assert "<|im_start|>" in target.chat_template
    assert target.dtype == torch.float32 and target.device.type == "cpu"


def test_aux_states_are_hf_hidden_states_at_recorded_ids_and_final_is_pre_norm(target):
    ids = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}],
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    aux, final = target.hidden_states(ids, None)
    with torch.no_grad():
        ref = target.model(ids, output_hidden_states=True)
    h = target.hidden_size
    for j, k in enumerate(target.aux_layer_ids):
        torch.testing.assert_close(aux[..., j * h : (j + 1) * h], ref.hidden_states[k], rtol=0, atol=0)
    # HF's last hidden state is after the final norm; ours is before it, and reproduces the logits.
    assert not torch.allclose(final, ref.hidden_states[-1], atol=1e-2)
    torch.testing.assert_close(target.final_norm(final), ref.hidden_states[-1])
    torch.testing.assert_close(target.logits_from_final(final), ref.logits)


def test_layer_id_zero_is_the_embeddings(target):
    from speculators_train.target import Target

    t0 = Target(target.model, target.tokenizer, "x", None, [0, 7], target.device)
    ids = torch.tensor([[1, 4093, 198, 6004, 2]])
    aux, _ = t0.hidden_states(ids, None)
    with torch.no_grad():
        ref = target.model(ids, output_hidden_states=True).hidden_states
    h = target.hidden_size
    torch.testing.assert_close(aux[..., :h], target.embed_tokens(ids))
    torch.testing.assert_close(aux[..., h:], ref[7])


def test_out_of_range_layer_ids_are_refused():
    # id 8 (after the last layer) is excluded too: engines capture aux states below N.
    with pytest.raises(UserError, match=r"aux_layer_ids: \[8\] out of range for a target with 8 layers"):
        load_target(TargetConfig(name_or_path=tiny_config().name_or_path, aux_layer_ids=[2, 8]))


@pytest.mark.parametrize("num_layers", [1, 3, 4, 6])
def test_a_target_too_shallow_for_the_default_aux_ids_is_told_to_set_them(num_layers):
    with pytest.raises(UserError, match=r"target\.aux_layer_ids: the default \[2, N//2, N-3\] is .* not 3 distinct"):
        default_aux_layer_ids(num_layers)
    assert default_aux_layer_ids(7) == [2, 3, 4] and default_aux_layer_ids(30) == [2, 15, 27]


def test_gguf_is_converted_once_and_reused():
    """The embedded default's own GGUF file: the conversion every SmolLM2 run (the demo) reads."""
    named = NAMED_TARGETS["smollm2-135m-instruct"]
    first, hub = resolve_origin(TargetConfig())
    stamp = os.stat(f"{first}/config.json").st_mtime_ns
    gguf = _package_dir(named.package) / named.gguf_file
    again, _ = resolve_origin(TargetConfig(name_or_path=str(gguf)))
    assert again == first and os.stat(f"{first}/config.json").st_mtime_ns == stamp
    assert hub == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("./missing.gguf", "GGUF file missing.gguf not found"),
        ("/nonexistent/dir", "neither a directory, a .gguf file, nor a hub id"),
    ],
)
def test_bad_target_paths(name, message):
    with pytest.raises(UserError, match=message):
        resolve_origin(TargetConfig(name_or_path=name))


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(UserError, match=r"without config\.json"):
        resolve_origin(TargetConfig(name_or_path=str(tmp_path)))


def test_cached_copy_gives_the_same_logits_as_the_gguf(smollm2):
    """The embedded default's GGUF file against its dequantised copy: only SmolLM2 ships as GGUF."""
    from transformers import AutoModelForCausalLM

    named = NAMED_TARGETS["smollm2-135m-instruct"]
    gguf = AutoModelForCausalLM.from_pretrained(
        _package_dir(named.package), gguf_file=named.gguf_file, dtype=torch.float32
    )
    ids = torch.tensor([[1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198]])
    with torch.no_grad():
        torch.testing.assert_close(smollm2.model(ids).logits, gguf(ids).logits, rtol=0, atol=0)


SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "vocab_size": 97,
}


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("llama", {}),
        ("gemma", {}),
        ("gemma2", {"final_logit_softcapping": 3.0}),
        ("granite", {"logits_scaling": 8.0}),
        ("cohere", {"logit_scale": 0.0625}),
    ],
)
def test_training_head_gives_the_targets_own_logits(tmp_path, model_type, extra):
    """TargetHead, built from the saved weights without the model, turns the last pre-norm state into the model's
    logits: Llama's RMSNorm, Gemma's x * (1 + w), Gemma 2's soft-capping, Granite's division by logits_scaling and
    Cohere's multiplication by logit_scale (each read off the class's own forward)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from speculators_train.head import TargetHead, load_head_weights

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **SMALL, **extra)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        model.model.norm.weight.normal_(0, 0.5)  # Gemma starts it at 0 (an offset from 1), Llama at 1
        model.lm_head.weight.normal_(0, 1)  # logits of a few units, so the cap bends them
    model.save_pretrained(tmp_path)
    target_config, weights = load_head_weights(TargetConfig(name_or_path=str(tmp_path)))
    head = TargetHead.from_weights(target_config, weights)

    finals = []
    hook = model.model.layers[-1].register_forward_hook(lambda _m, _a, out: finals.append(out))
    with torch.no_grad():
        ref = model(torch.randint(0, 97, (1, 9))).logits
    hook.remove()
    final = finals[0][0] if isinstance(finals[0], tuple) else finals[0]
    torch.testing.assert_close(head(final), ref)
    if model_type != "llama":  # Llama's head is measurably wrong here
        llama = LlamaRMSNorm(32, eps=getattr(config, "rms_norm_eps", None) or config.layer_norm_eps)
        llama.weight.data.copy_(weights["norm"])
        assert not torch.allclose(TargetHead(llama, weights["lm_head"])(final), ref, atol=1e-2)


def test_every_matrix_target_has_its_logit_transform_measured(monkeypatch):
    """The probe runs each class's own forward, multimodal wrappers included (Gemma 3 and Qwen2.5-VL read extras
    off their inner model's output, Llama-4 embeds the ids itself and calls a causal LM): each gives its transform.
    What counts is what the class computes, not what its config holds: Gemma 3's text model caps at its text
    config's `final_logit_softcapping`, its multimodal wrapper does not."""
    from speculators_train import head
    from tests.targets import MATRIX, config_of

    monkeypatch.setattr(head, "_TRANSFORMS", {})
    expected = {"gemma2": head.LogitTransform(cap=30.0), "granitemoe": head.LogitTransform(8.0, divide=True)}
    for arch in MATRIX:
        assert head.logit_transform(config_of(arch)) == expected.get(arch.name, head.LogitTransform()), arch.name
    for name, transform in (("gemma3-text", head.LogitTransform(cap=5.0)), ("gemma3", head.LogitTransform())):
        config = config_of(next(arch for arch in MATRIX if arch.name == name))
        config.get_text_config().final_logit_softcapping = 5.0
        assert head.logit_transform(config) == transform, name


def test_a_target_head_that_is_not_reproduced_is_refused(monkeypatch):
    """A class whose logits are no scale and cap of its lm_head's output (here: cubed) is refused in one line."""
    from transformers import CohereConfig

    from speculators_train import head

    monkeypatch.setattr(head, "_TRANSFORMS", {})  # not the measurement of an earlier test
    monkeypatch.setattr(head, "_probe", lambda config, values: values.double() ** 3)
    with pytest.raises(UserError, match=r"target model_type 'cohere' transforms its logits in a way the training"):
        head.TargetHead.from_weights(CohereConfig(**SMALL), {})


def test_a_head_training_cannot_reproduce_is_refused_when_the_recipe_loads(tmp_path, capsys, monkeypatch):
    """Refused by `data`, before generate's work, not first by `train` (a Granite target once was)."""
    from speculators_train import head
    from tests.conftest import SHAREGPT, make_recipe
    from tests.faults import clean_error

    monkeypatch.setattr(head, "_TRANSFORMS", {})
    monkeypatch.setattr(head, "_probe", lambda config, values: values.double() ** 3)
    recipe = make_recipe(tmp_path, [{"name": "s", "path": SHAREGPT, "max_records": 8}])
    clean_error(["data", recipe], capsys, "transforms its logits in a way the training head does not reproduce")
