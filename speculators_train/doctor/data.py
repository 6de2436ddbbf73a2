"""Data against serve: what the training states were made with (the hidden-state manifest's identity) against the
target as it is now and the dtype the draft is served in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from speculators_train.doctor.report import Check
from speculators_train.errors import UserError
from speculators_train.families.base import LoadedDraft
from speculators_train.families.vocab import build_vocab_mapping, draft_to_target
from speculators_train.hidden_states.shards import read_manifest, read_token_freq
from speculators_train.layout import TOKEN_FREQ

# identity key -> (what it is, the fix when the target's differs)
RENDERING = {
    "chat_template_hash": (
        "chat template",
        "the target's chat template changed after the states were made: the server renders prompts the draft never "
        "saw; regenerate the states (`speculators-train generate`) and retrain, or serve with the old template",
    ),
    "tokenizer_hash": (
        "tokenizer",
        "the target's tokenizer changed after the states were made; regenerate the states and retrain",
    ),
}


def check_data(states_dir: Path, now: dict[str, Any], serve_dtype: str) -> list[Check]:
    """`now`: the target's identity today (`Target.identity`)."""
    try:
        stored = read_manifest(states_dir)["identity"]
    except UserError as exc:
        return [Check("training data against the target", "skip", str(exc))]
    checks = []
    for key, (what, fix) in RENDERING.items():
        same = stored.get(key) == now.get(key)
        detail = f"{what} of the training states {'is' if same else 'is not'} the target's ({stored.get(key)}"
        detail += ")" if same else f" there, {now.get(key)} now)"
        checks.append(
            Check(f"{what}: training against serving", "pass" if same else "fail", detail, "" if same else fix)
        )
    stored_dtype = stored.get("storage_dtype")
    engine = stored.get("capture_engine", "transformers")
    same = stored_dtype == serve_dtype
    checks.append(
        Check(
            "state dtype: training against serving",
            "pass" if same else "warn",
            f"states captured by {engine} in {stored_dtype}, the draft served in {serve_dtype}",
            ""
            if same
            else f"capture the states in {serve_dtype} (generation.storage_dtype) or serve the draft in "
            f"{stored_dtype} (export.dtype): the draft learnt the rounding of the states it read",
        )
    )
    return checks


def check_vocab_map(states_dir: Path, loaded: LoadedDraft) -> Check:
    """The draft's vocabulary (d2t) against the one the training states' token counts give (`build_vocab_mapping`
    over token_freq.safetensors): a map built from other data caps acceptance on these prompts' tokens."""
    name = "draft vocabulary from the training data's token counts"
    d2t = getattr(loaded.draft, "d2t", None)
    if d2t is None:
        return Check(name, "pass", "the draft proposes every target id")
    try:
        freq = read_token_freq(states_dir, read_manifest(states_dir))
    except UserError as exc:
        return Check(name, "skip", str(exc))
    ours = set(draft_to_target(d2t.cpu()).tolist())
    counted, _ = build_vocab_mapping(freq, min(d2t.numel(), freq.numel()))
    theirs = {t for t in draft_to_target(counted).tolist() if freq[t] > 0}  # unseen ids only pad the map
    missing = len(theirs - ours)
    detail = f"{missing} of the {len(theirs)} most frequent training tokens are outside the draft's {d2t.numel()}-id "
    detail += f"vocabulary ({states_dir / TOKEN_FREQ})"
    if missing:
        fix = "the vocabulary came from other data (another run, an imported draft): train from these states, or "
        fix += "check that the draft was meant for this data"
        return Check(name, "warn", detail, fix)
    return Check(name, "pass", detail)


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def check_verifier(on_disk: dict[str, Any] | None, states_dir: Path, now: dict[str, Any]) -> Check:
    """The target's revision and config hash recorded by the training states and by the export, against the target
    as it reads now (`origin.target_fingerprint`): a target replaced under the same name serves a draft trained on
    another model's states."""
    name = "verifier: training states and export against the target now"
    block = _object(_object(on_disk).get("speculators_config")).get("verifier")
    try:
        stored = read_manifest(states_dir).get("target_config")
    except UserError:
        stored = None
    # a fingerprint is an object with a string config hash; anything else (edited, another version) records none
    found = (("the training states", _object(stored)), ("the export", _object(block)))
    seen = [(where, {k: fp.get(k) for k in ("revision", "config_hash")}) for where, fp in found
            if isinstance(fp.get("config_hash"), str)]  # fmt: skip
    if not seen:
        detail = "neither the training states nor the export record the target's revision and config hash"
        return Check(name, "skip", detail, "export again (`export --force`) to record them")
    detail = f"the target now: revision {now['revision']}, config {now['config_hash']}"
    other = [f"{where}: revision {fp['revision']}, config {fp['config_hash']}" for where, fp in seen
             if fp["config_hash"] != now["config_hash"]]  # fmt: skip
    moved = [f"{where}: revision {fp['revision']}" for where, fp in seen
             if fp["config_hash"] == now["config_hash"] and None not in (fp["revision"], now["revision"])
             and fp["revision"] != now["revision"]]  # fmt: skip
    fix = "serve the target the draft was trained for (pin target.revision to the recorded one), or capture states, "
    fix += "train and export again from this target"
    if other:
        return Check(name, "fail", "; ".join([detail, *other]), fix)
    if moved:
        return Check(name, "warn", "; ".join([detail + " (the same config)", *moved]), fix)
    return Check(name, "pass", f"{detail}; {' and '.join(w for w, _ in seen)} record{'s' * (len(seen) == 1)} the same")
