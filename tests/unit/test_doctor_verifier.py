"""The verifier's provenance: what the training states and the export record of the target, against it now."""

import json

from speculators_train.doctor.data import check_verifier
from speculators_train.doctor.serve import config_diffs
from speculators_train.families.format_common import proposal_config, stamp_verifier
from speculators_train.hidden_states.shards import FORMAT, VERSION
from speculators_train.layout import MANIFEST

OLD = {"revision": "abc123", "config_hash": "sha256:1111"}
NEW = {"revision": "def456", "config_hash": "sha256:2222"}


def export_config(fingerprint: dict | None) -> dict:
    config = {"speculators_config": proposal_config("eagle3", 3, "org/model", ["LlamaForCausalLM"])}
    if fingerprint:
        stamp_verifier(config, fingerprint)
    return config


def states(tmp_path, fingerprint: dict | None):
    identity = {"aux_layer_ids": [1], "hidden_size": 8, "vocab_size": 16, "storage_dtype": "float32",
                "data_fingerprint": "f"}  # fmt: skip
    splits = {"train": {"shards": []}, "held_out": {"shards": []}}
    manifest = {"format": FORMAT, "version": VERSION, "identity": identity, "splits": splits}
    if fingerprint:
        manifest["target_config"] = fingerprint
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    return tmp_path


def test_the_export_records_the_verifiers_revision_and_config_hash_beside_its_name():
    verifier = export_config(OLD)["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": "org/model", "architectures": ["LlamaForCausalLM"], **OLD}
    # doctor's field-by-field comparison leaves them to the provenance check (a fresh write has none)
    assert config_diffs(export_config(None), export_config(OLD)) == []
    assert config_diffs(export_config(None), {**export_config(None), "draft_vocab_size": 3}) != []


def test_a_target_replaced_under_the_same_name_fails_naming_both_records(tmp_path):
    check = check_verifier(export_config(OLD), states(tmp_path, OLD), NEW)
    assert check.status == "fail" and "pin target.revision" in check.fix
    assert "the training states: revision abc123, config sha256:1111" in check.detail
    assert "the export: revision abc123" in check.detail and "the target now: revision def456" in check.detail


def test_states_of_another_target_fail_even_when_the_export_matches(tmp_path):
    check = check_verifier(export_config(NEW), states(tmp_path, OLD), NEW)
    assert check.status == "fail" and "the training states" in check.detail and "the export:" not in check.detail


def test_a_new_commit_with_the_same_config_warns_and_a_match_passes(tmp_path):
    same_config = {**OLD, "revision": "fff999"}
    assert check_verifier(export_config(same_config), states(tmp_path, OLD), OLD).status == "warn"
    assert check_verifier(export_config(OLD), states(tmp_path, OLD), OLD).status == "pass"
    local = {"revision": None, "config_hash": OLD["config_hash"]}  # a local folder has no revision to compare
    assert check_verifier(export_config(local), states(tmp_path, OLD), local).status == "pass"


def test_records_made_before_provenance_was_kept_skip(tmp_path):
    assert check_verifier(export_config(None), states(tmp_path, None), OLD).status == "skip"
    assert check_verifier(None, tmp_path / "missing", OLD).status == "skip"


def test_the_config_hash_follows_the_model_not_where_or_how_it_was_saved(tmp_path):
    from speculators_train.origin import TargetConfig, target_fingerprint

    def target(name: str, **config) -> TargetConfig:
        path = tmp_path / name
        path.mkdir()
        base = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100}
        (path / "config.json").write_text(json.dumps({**base, **config}))
        (path / "model.safetensors").write_bytes(b"")
        return TargetConfig(name_or_path=str(path))

    a = target_fingerprint(target("a"))
    assert a["revision"] is None and a["config_hash"].startswith("sha256:")
    saved_elsewhere = target("b", _name_or_path="/elsewhere", transformers_version="9.9", torch_dtype="bfloat16")
    assert target_fingerprint(saved_elsewhere) == a
    assert target_fingerprint(target("c", num_hidden_layers=3))["config_hash"] != a["config_hash"]
