"""Evaluation suites: YAML files under eval/suites/ naming where prompts come from.

A prompt is a conversation up to its first assistant turn (system + first user message), rendered with the target's
chat template and its generation prompt. By default a suite reads the recipe's held-out split, which training never
sees; a suite with its own `mix` drops every conversation of the recipe's training split.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from speculators_train.data.conversations import Conversation, SkipReport
from speculators_train.data.mix import load_mix
from speculators_train.data.regenerate import regenerate
from speculators_train.errors import UserError
from speculators_train.recipe import Recipe, RegenerateConfig
from speculators_train.schema import Section, load_yaml_model


class SuiteConfig(Section):
    name: str
    description: str = ""
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


def load_suite(path: Path, recipe: Recipe, tokenizer, num_prompts: int | None = None) -> Suite:
    cfg = load_yaml_model(path, SuiteConfig, "eval suite")
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
        first_user = next(m["content"] for m in messages if m["role"] == "user")
        if pattern is not None and not pattern.search(first_user):
            continue
        if exclude is not None and exclude.search(first_user):
            continue
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
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
    out = regenerate(todo, target.model, target.tokenizer, cfg, recipe.data.max_length, recipe.seed)
    return [c for c in out if c.messages[-1]["role"] == "assistant" and c.messages[-1]["content"]]
