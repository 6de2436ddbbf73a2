"""Target loading and the layer-id convention, on the real SmolLM2 target."""

import os

import pytest
import torch

from speculators_train.errors import UserError
from speculators_train.recipe import TargetConfig
from speculators_train.target import NAMED_TARGETS, _package_dir, load_target, resolve_source


def test_exposes_shape_template_and_default_ids(target):
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    assert target.aux_layer_ids == [2, 15, 27]
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

    t0 = Target(target.model, target.tokenizer, "x", None, [0, 29], target.device)
    ids = torch.tensor([[1, 4093, 198, 6004, 2]])
    aux, _ = t0.hidden_states(ids, None)
    with torch.no_grad():
        ref = target.model(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(aux[..., :576], target.embed_tokens(ids))
    torch.testing.assert_close(aux[..., 576:], ref[29])


def test_out_of_range_layer_ids_are_refused():
    # id 30 (after the last layer) is excluded too: engines capture aux states below N.
    with pytest.raises(UserError, match=r"aux_layer_ids: \[30\] out of range for a target with 30 layers"):
        load_target(TargetConfig(aux_layer_ids=[2, 30]))


def test_gguf_is_converted_once_and_reused():
    named = NAMED_TARGETS["smollm2-135m-instruct"]
    first, hub = resolve_source(TargetConfig())
    stamp = os.stat(f"{first}/config.json").st_mtime_ns
    gguf = _package_dir(named.package) / named.gguf_file
    again, _ = resolve_source(TargetConfig(name_or_path=str(gguf)))
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
        resolve_source(TargetConfig(name_or_path=name))


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(UserError, match=r"without config\.json"):
        resolve_source(TargetConfig(name_or_path=str(tmp_path)))


@pytest.mark.slow
def test_cached_copy_gives_the_same_logits_as_the_gguf(target):
    from transformers import AutoModelForCausalLM

    named = NAMED_TARGETS["smollm2-135m-instruct"]
    gguf = AutoModelForCausalLM.from_pretrained(
        _package_dir(named.package), gguf_file=named.gguf_file, dtype=torch.float32
    )
    ids = torch.tensor([[1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198]])
    with torch.no_grad():
        torch.testing.assert_close(target.model(ids).logits, gguf(ids).logits, rtol=0, atol=0)
