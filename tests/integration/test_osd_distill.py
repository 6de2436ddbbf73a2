"""Online distillation with the session target on real ShareGPT prompts and its own replies written as production
logs: a draft
is scored, distilled on the records it fails, and promoted (exported, `current` re-pointed) only when the gate
says it is better; a worse candidate is refused and the reason recorded; a rerun resumes where it stopped."""

import json

import pytest
import torch
import yaml

from speculators_train.data.conversations import SkipReport
from speculators_train.data.mix import load_mix_config, read_source
from speculators_train.errors import UserError
from speculators_train.osd.distill import OnlineDistiller
from speculators_train.osd.scoring import Buffer, Scored, gate
from speculators_train.recipe import load_recipe
from speculators_train.target import StateSpec
from speculators_train.training.checkpoint import save_checkpoint
from tests.conftest import SHAREGPT, make_recipe, start_of, tiny_config


def test_gate_promotes_only_a_gain_on_logs_without_a_loss_on_the_general_suite():
    assert gate((1.30, 1.20), (1.20, 1.21), margin=0.02, min_gain=0.0)[0]
    refused, why = gate((1.19, 1.30), (1.20, 1.20), margin=0.02, min_gain=0.0)
    assert not refused and "log-slice AL 1.190 does not beat the current 1.200" in why
    refused, why = gate((1.40, 1.15), (1.20, 1.20), margin=0.02, min_gain=0.0)
    assert not refused and "general AL 1.150 lost more than 0.02 from the deployed 1.200" in why
    assert not gate((1.205, 1.2), (1.2, 1.2), margin=0.02, min_gain=0.01)[0]
    assert not gate((1.2, 1.2), (1.2, 1.2), margin=0.02, min_gain=0.0)[0]  # a tie is not a gain


def test_buffer_keeps_the_records_the_draft_failed_on():
    buffer = Buffer(2)
    for name, rejected in (("a", 0.1), ("b", 0.9), ("c", 0.5), ("d", 0.05)):
        buffer.add(Scored(name, {}, 1.0, rejected))
    assert sorted(item.id for item in buffer.items) == ["b", "c"]


_REPLIES: dict[tuple[str, str], str] = {}


def served_reply(target, conv_id: str, user: dict) -> str:
    """The target's greedy reply to one user turn (48 tokens at most), as a server running it logs it; kept for the
    session."""
    from speculators_train.data.chat import Chat
    from speculators_train.proposal import Sampling
    from speculators_train.verify.decoder import decode_plain
    from speculators_train.verify.run import eos_ids
    from speculators_train.verify.suites import chat_ids

    key = (target.name_or_path, conv_id)
    if key not in _REPLIES:
        prompt = chat_ids(Chat(target.tokenizer), [user])
        tokens = decode_plain(target, prompt, 48, eos_ids(target), Sampling()).tokens
        _REPLIES[key] = target.tokenizer.decode(tokens, skip_special_tokens=True)
    return _REPLIES[key]


def log_lines(tmp_path, target, n: int, skip: int = 0) -> list[str]:
    """ShareGPT first turns and the target's own replies to them, written as OpenAI chat logs (what a server running
    the target logs; a random-weight target's next token on someone else's reply is noise to a draft)."""
    mix_path = tmp_path / "logs-mix.yaml"
    source = {"name": "logs", "path": SHAREGPT, "max_records": 200}
    mix_path.write_text(yaml.safe_dump({"seed": 0, "sources": [source]}))
    mix = load_mix_config(mix_path)
    out = []
    for conv in read_source(mix, mix.sources[0], SkipReport()):
        user, reply = conv.messages[0], conv.messages[1]
        if user["role"] == "user" and reply["role"] == "assistant" and len(user["content"]) < 400:
            response = served_reply(target, conv.id, user) if len(out) >= skip else ""
            out.append(json.dumps({"id": conv.id, "messages": [user], "response": response}))
        if len(out) == skip + n:
            return out[skip:]
    raise AssertionError("not enough records")


def fresh_draft_on_logs(tmp_path, target, settings: dict, aux_layer_ids: list[int], prepare=None):
    """(recipe, logs dir, the starting draft): a fresh draft of `settings`' family (vocabulary: the 2048 lowest ids,
    BPE's most frequent merges) as `osd.init_from`, and one window of 24 real chat log records to distil on."""
    from speculators_train import families
    from speculators_train.head import load_head_weights

    family = families.get(settings["family"])
    config, weights = load_head_weights(tiny_config())
    freq = torch.zeros(target.vocab_size, dtype=torch.int64)
    freq[:2048] = 1
    torch.manual_seed(0)
    start = family.new_draft(family.settings(**settings), start_of(config, weights, freq, aux_layer_ids))
    if prepare is not None:
        prepare(start)
    init = save_checkpoint(tmp_path / "init", 1, start, None, {"step": 1}, keep_last=1)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "day1.jsonl").write_text("\n".join(log_lines(tmp_path, target, 24)) + "\n")
    osd = {"init_from": str(init), "update_interval": 24, "steps_per_update": 15, "learning_rate": 2e-3}
    osd.update(held_out_fraction=0.25, general_records=2, buffer_size=12)
    recipe = make_recipe(
        tmp_path,
        [{"name": "sharegpt", "path": SHAREGPT, "max_records": 30}],
        osd=osd,
        draft=settings,
        eval={"num_speculative_tokens": 3, "max_new_tokens": 24},
        training={"wandb": {"mode": "disabled"}},
    )
    return load_recipe(recipe), logs, start


@pytest.fixture
def setup(tmp_path, random_draft, target):
    init = save_checkpoint(tmp_path / "init", 1, random_draft, None, {"step": 1}, keep_last=1)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "day1.jsonl").write_text("\n".join(log_lines(tmp_path, target, 20)) + "\n")
    osd = {
        "init_from": str(init),
        "update_interval": 10,
        "steps_per_update": 6,
        "learning_rate": 4e-3,
        "held_out_fraction": 0.25,
        "general_records": 2,
        "buffer_size": 6,
    }
    recipe = make_recipe(
        tmp_path,
        [{"name": "sharegpt", "path": SHAREGPT, "max_records": 30}],
        osd=osd,
        draft={"family": "eagle3", "ttt_steps": 3},
        eval={"num_speculative_tokens": 3, "max_new_tokens": 16},
        training={"wandb": {"mode": "offline"}},
    )
    return load_recipe(recipe), logs


def test_distillation_promotes_a_better_draft_refuses_a_worse_one_and_resumes(tmp_path, setup, target):
    recipe, logs = setup
    root = recipe.run_dir / "osd"
    first_run = OnlineDistiller(recipe, logs, target)
    history = first_run.run()
    assert [r["records_seen"] for r in history] == [10, 20]  # two full windows of update_interval records
    first = history[0]
    # A random draft accepts nothing; a few steps on the traffic it failed on must beat it on unseen log records.
    assert first["promoted"], first["reason"]
    assert first["candidate_log_al"] > first["log_al"] and first["version"] == 0
    assert (root / "current").resolve() == (root / "versions" / f"v{history[-1]['version_after']:04d}").resolve()
    config = json.loads((root / "current" / "speculators" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert (root / "acceptance.png").stat().st_size > 10_000
    assert len((root / "history.jsonl").read_text().splitlines()) == 2
    (tracked,) = (root / "wandb").glob("offline-run-*/run-test-osd.wandb")
    assert b"candidate_log_al" in tracked.read_bytes()
    version = history[-1]["version_after"]

    # Resume: nothing new, nothing redone; then a worse candidate (a learning rate that wrecks it) is refused.
    # A kill between exporting a version and committing the window left `current` ahead of progress.json.
    (root / "current").unlink()
    (root / "current").symlink_to(f"versions/v{version + 1:04d}")
    again = OnlineDistiller(recipe, logs, target)
    assert (root / "current").resolve() == (root / "versions" / f"v{version:04d}").resolve()
    assert again.progress["consumed"] == 20 and again.run() == []
    # The trainee resumes where it was, optimizer moments included, not from the deployed version.
    for name, value in first_run.trainee.state_dict().items():
        torch.testing.assert_close(again.trainee.state_dict()[name], value, msg=name)
    moments = [s["exp_avg"] for s in again.optimizer.state.values()]
    first_moments = [s["exp_avg"] for s in first_run.optimizer.state.values()]
    assert moments and all(torch.equal(a, b) for a, b in zip(moments, first_moments, strict=True))
    with open(logs / "day1.jsonl", "a") as fh:
        fh.write("\n".join(log_lines(tmp_path, target, 20, skip=20)) + "\n")
    again.cfg.learning_rate = 3.0
    refusals = again.run()
    assert all(not r["promoted"] and "does not beat the current" in r["reason"] for r in refusals), refusals
    assert all(r["version_after"] == version for r in refusals)
    # The second refusal in a row (restart_after_refusals: 2) restarts the trainee from the deployed version, and a
    # restart starts the count again: the first run's last window, promoted or not, decides which refusal it is.
    streak = 0 if history[-1]["promoted"] else 1
    assert [r["trainee_restarted"] for r in refusals] == ([False, True] if streak == 0 else [True, False])
    restarted = next(r for r in refusals if r["trainee_restarted"])
    if refusals[-1] is restarted:
        for name, value in again.draft.state_dict().items():
            torch.testing.assert_close(again.trainee.state_dict()[name], value, msg=name)
        assert not again.optimizer.state

    # The general suite was frozen with the first run; a recipe that now asks for another one cannot silently
    # compare new versions against a baseline measured on the old one.
    recipe.osd.general_records = 3
    with pytest.raises(UserError, match=r"general\.json: frozen from eval.suites .* x 2 records"):
        OnlineDistiller(recipe, logs, target)
    assert (root / "current").resolve() == (root / "versions" / f"v{version:04d}").resolve()
    assert json.loads((root / "history.jsonl").read_text().splitlines()[-1])["reason"] == refusals[-1]["reason"]


def test_the_general_suite_is_captured_at_the_layers_the_adapted_draft_reads(tmp_path, target):
    from speculators_train.families.eagle.model import Eagle3Config, Eagle3Draft

    draft = Eagle3Draft(Eagle3Config.for_target(target.config, [1, 3, 6], 256, False))
    init = save_checkpoint(tmp_path / "init", 1, draft, None, {"step": 1}, keep_last=1)
    logs = tmp_path / "logs"
    logs.mkdir()
    sources = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 30}]
    recipe = load_recipe(
        make_recipe(tmp_path, sources, osd={"init_from": str(init), "general_records": 2}, eval={"max_new_tokens": 16})
    )
    distiller = OnlineDistiller(recipe, logs, target)
    sample = distiller.general[0]
    ids = sample["input_ids"][None]
    aux, _ = target.hidden_states(ids, torch.ones_like(ids), StateSpec((1, 3, 6)))
    torch.testing.assert_close(sample["aux_hidden_states"].float(), aux[0], rtol=1e-4, atol=1e-4)
    assert target.aux_layer_ids == [2, 4, 5], "the draft's layers are passed to each capture, not set on the target"


def test_medusa_heads_are_scored_distilled_gated_and_versioned_by_the_same_loop(tmp_path, target):
    """Online distillation is not EAGLE-3's: heads read only the final state, train through the trainer's step with
    the OSD divergence, and each version is exported in their own (vLLM Medusa) format."""
    from speculators_train.families.drafts import draft_state_dict

    settings = {"family": "medusa", "num_heads": 3, "draft_vocab_size": 2048}

    def noise(heads) -> None:
        # Heads start as the target's own lm_head, which names token t+1; a random target's replies repeat tokens,
        # so t+1 is often t+2 there too. Heads started from noise give distillation a start it must beat.
        with torch.no_grad():
            for head in heads.lm_heads:
                head.weight.normal_(0, 0.02)

    recipe, logs, heads = fresh_draft_on_logs(tmp_path, target, settings, [], noise)
    distiller = OnlineDistiller(recipe, logs, target)
    assert distiller.general and all("aux_hidden_states" not in s for s in distiller.general)  # final state only
    (first,) = distiller.run()
    assert first["records_seen"] == 24
    assert first["promoted"], first["reason"]
    assert first["candidate_log_al"] > first["log_al"] >= 1.0
    trained = draft_state_dict(distiller.trainee)
    assert any(not torch.equal(trained[k], v) for k, v in draft_state_dict(heads).items())
    root = recipe.run_dir / "osd"
    for version in ("v0000", "v0001"):
        config = json.loads((root / "versions" / version / "speculators" / "config.json").read_text())
        assert config["model_type"] == "medusa" and config["num_heads"] == 3


def test_a_standalone_draft_model_is_adapted_online_as_in_the_osd_paper(tmp_path, target):
    """OSD's own setting (arXiv 2310.07177): a small causal LM, here the target's first two layers with its head,
    distilled on the target's replies to live traffic. It reads no target state but the final one, learns its
    whole body through the trainer's step, and each version is a plain model folder an engine loads."""
    from speculators_train.families.drafts import draft_state_dict

    settings = {"family": "draft_model", "start": "target_layers", "layers": [0, 1]}
    recipe, logs, start = fresh_draft_on_logs(tmp_path, target, settings, [])
    distiller = OnlineDistiller(recipe, logs, target)
    assert distiller.general and all("aux_hidden_states" not in s for s in distiller.general)
    (first,) = distiller.run()
    assert first["records_seen"] == 24
    assert first["promoted"], first["reason"]
    assert first["candidate_log_al"] > first["log_al"] >= 1.0
    trained, initial = draft_state_dict(distiller.trainee), draft_state_dict(start)
    changed = {k.split(".layers.")[-1].split(".")[0] for k, v in initial.items() if not torch.equal(trained[k], v)}
    assert {"0", "1"} <= changed, changed  # both kept layers learn, not only the head
    folder = recipe.run_dir / "osd" / "current" / recipe.export.format
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"]) == ("llama", 2)
    assert (folder / "tokenizer.json").is_file() and list(folder.glob("*.safetensors"))
