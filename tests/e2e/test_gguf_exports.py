"""Our files through llama.cpp's own code in its processes: each family's GGUF export, converted by llama.cpp's
`convert_hf_to_gguf.py` in a child, reads back to the trained draft and passes `doctor`, whose check converts the
checkpoint again and compares; a GGUF converted from an edited config is named with llama.cpp's key; and
llama-server regenerates replies. (The other export formats read back in tests/integration/test_families.py.)"""

import json
from pathlib import Path

import pytest

from speculators_train.data.chat import Chat
from speculators_train.data.config import RegenerateConfig
from speculators_train.data.conversations import Conversation
from speculators_train.export.run import export
from tests.integration.test_doctor import edit_config
from tests.integration.test_families import (  # noqa: F401 (head_weights and samples: fixtures)
    GGUF_FAMILIES,
    assert_export_reads_back,
    fresh_draft,
    head_weights,
    samples,
)


def test_llamacpp_reads_a_gguf_converted_from_an_edited_config_otherwise_and_doctor_names_the_key(
    fitted, target, tmp_path
):
    """The GGUF's metadata as llama.cpp's `gguf` package reads it, against a conversion of the checkpoint now: a
    clean GGUF export passes; one converted after its aux layer ids were shifted names llama.cpp's key."""
    from speculators_train.doctor.run import serve_checks
    from speculators_train.engines.llamacpp.converter import OUTTYPES, convert
    from speculators_train.export.run import local_config_dir
    from speculators_train.families.drafts import load_draft
    from speculators_train.origin import resolve_origin

    recipe, checkpoint, _, _ = fitted("eagle3")
    out = export(recipe, checkpoint, "gguf", tmp_path / "gguf", "float32").path

    def gguf_check():
        on_disk = json.loads((out / "config.json").read_text())
        checks = serve_checks(recipe, load_draft(checkpoint, target.num_layers), out, on_disk, "llama.cpp")
        return {c.name: c for c in checks}["llama.cpp reads the GGUF as trained"]

    assert gguf_check().status == "pass", gguf_check()
    trained = json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]

    def shift(config):
        config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config["eagle_aux_hidden_state_layer_ids"]]

    edit_config(shift)(out)
    target_dir = local_config_dir(resolve_origin(recipe.target)[0], recipe.target.revision)
    convert(out, out / "draft.gguf", OUTTYPES["float32"], target_dir=target_dir)
    check = gguf_check()
    assert check.status == "fail" and "export again" in check.fix
    assert (
        check.detail == f"eagle3.target_layers: trained {trained!r}, llama.cpp will read {[i + 1 for i in trained]!r}"
    )


@pytest.mark.timeout(3600)  # the first run on a machine builds llama.cpp
def test_llamacpp_regeneration_answers_each_turn_from_the_served_gguf(target, tmp_path):
    """llama-server answers, each turn conditioned on the regenerated earlier turns. With one slot on an unquantized
    GGUF that is exactly what one request of the same rendered prompt returns. In parallel slots the kernels round
    differently with the batch width and fork at near-ties (SPEC.md section 10; often on the served Q4_1 file, and
    on F32 too on a CPU without AVX-512): there every turn is still the server's answer, not the original text, and
    no token-level equality is asserted."""
    from speculators_train.data.regenerate import regenerate_llamacpp
    from speculators_train.engines.llamacpp.server import Server
    from speculators_train.engines.llamacpp.verify import f32_gguf
    from speculators_train.origin import gguf_file, resolve_origin
    from speculators_train.recipe import TargetConfig

    tok = target.tokenizer
    convs = [
        Conversation(
            f"t:{i}",
            (
                {"role": "user", "content": question},
                {"role": "assistant", "content": "ORIGINAL ONE"},
                {"role": "user", "content": "Say it again, shorter."},
                {"role": "assistant", "content": "ORIGINAL TWO"},
            ),
            "x",
        )
        for i, question in enumerate(["Name a fruit.", "What is 2 + 2?", "Name a colour.", "Say hello."])
    ]
    cfg = RegenerateConfig(enabled=True, max_new_tokens=12, batch_size=4, engine="llama.cpp")
    served = regenerate_llamacpp(convs, Chat(tok), cfg, max_length=512, seed=0, gguf=gguf_file(TargetConfig()))
    for conv, regenerated in zip(convs, served, strict=True):
        assert [m["role"] for m in regenerated.messages] == ["user", "assistant", "user", "assistant"]
        for turn in (1, 3):
            assert regenerated.messages[turn]["content"].strip()
            assert regenerated.messages[turn]["content"] != conv.messages[turn]["content"]
    # One slot: batched slots fork from a lone request at near-ties even on F32 (seen on a CPU without AVX-512).
    f32 = f32_gguf(Path(resolve_origin(TargetConfig())[0]))
    one = cfg.model_copy(update={"batch_size": 1})
    out = regenerate_llamacpp(convs, Chat(tok), one, max_length=512, seed=0, gguf=f32)
    with Server(f32, [], tmp_path / "one.log") as server:
        for conv, regenerated in zip(convs, out, strict=True):
            assert [m["role"] for m in regenerated.messages] == ["user", "assistant", "user", "assistant"]
            for turn in (1, 3):
                history = [*regenerated.messages[:turn]]
                prompt = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
                ids = tok(prompt, add_special_tokens=False)["input_ids"]
                alone = tok.decode(server.generate(ids, 12, 0.0, 1.0, 0), skip_special_tokens=True).strip()
                assert regenerated.messages[turn]["content"] == alone != conv.messages[turn]["content"]


@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_every_gguf_export_reads_back_to_the_same_draft(
    tmp_path,
    target,
    head_weights,  # noqa: F811 (the fixture imported above)
    samples,  # noqa: F811
    name,
    monkeypatch,
):
    """The GGUF formats of tests/integration/test_families.py's read-back. doctor's fresh GGUF is converted from a
    folder of the export's name: an unchanged export is the same bytes, recognised without parsing a target
    vocabulary's arrays twice."""
    from speculators_train.engines.llamacpp import doctor

    monkeypatch.setattr(doctor, "gguf_contents", lambda path: pytest.fail(f"{path} parsed: the bytes differ"))
    fresh = fresh_draft(name, target, head_weights, samples)
    assert assert_export_reads_back(tmp_path, target, fresh, gguf=True)
