"""Acceptance explained by the token the target emits next: at each verify step of the loop, whether the first
draft was accepted, grouped by the class of the token the target put there (the first token of a reply, a token
outside the draft vocabulary, whitespace, digits, code symbols, words). A class far below the rest says what the
draft has not learnt, or cannot propose."""

from __future__ import annotations

from collections.abc import Callable

from speculators_train.doctor.report import Check
from speculators_train.verify.decoder import Generation

CLASSES = ("first token of a reply", "outside the draft vocabulary", "whitespace", "digits", "code symbols", "words")
CODE_SYMBOLS = set("{}[]()<>;=+-*/%&|^!~`\\:#@$")
LOW = 0.5  # a class accepted at under this share of the overall first-draft rate is named
MIN_STEPS = 10  # fewer steps than this say nothing about a class


def token_class(text: str, first: bool, inside: bool) -> str:
    """The first class that fits, in `CLASSES` order."""
    stripped = text.strip()
    if first:
        return CLASSES[0]
    if not inside:
        return CLASSES[1]
    if not stripped:
        return CLASSES[2]
    if any(c.isdigit() for c in stripped):
        return CLASSES[3]
    if all(c in CODE_SYMBOLS for c in stripped):
        return CLASSES[4]
    return CLASSES[5]


def acceptance_by_class(
    generations: list[Generation], text: Callable[[int], str], inside: Callable[[int], bool]
) -> dict[str, tuple[int, int]]:
    """{class: (steps whose first draft was accepted, steps)} over every verify step of `generations`, classed by the
    target's token at the step's first position."""
    counts = {c: [0, 0] for c in CLASSES}
    for g in generations:
        at = 0
        for accepted in g.accepted:
            if at >= len(g.tokens):  # a last step cut at EOS or the token limit
                break
            token = g.tokens[at]
            kept = counts[token_class(text(token), at == 0, inside(token))]
            kept[0] += accepted > 0
            kept[1] += 1
            at += accepted + 1
    return {c: (a, n) for c, (a, n) in counts.items() if n}


def check_classes(counts: dict[str, tuple[int, int]], where: str) -> Check:
    name = "first-draft acceptance by the target's next token"
    steps = sum(n for _, n in counts.values())
    if not steps:
        return Check(name, "skip", f"no verify step on {where}")
    overall = sum(a for a, _ in counts.values()) / steps
    detail = f"on {where}, overall {overall:.0%} of {steps} steps: "
    detail += ", ".join(f"{c} {a}/{n} ({a / n:.0%})" for c, (a, n) in counts.items())
    low = [c for c, (a, n) in counts.items() if n >= MIN_STEPS and a / n < LOW * overall]
    if low:
        fix = f"{', '.join(low)}: accepted at under half the overall rate; more training data with such tokens "
        fix += "(or, outside the vocabulary, a larger draft_vocab_size) is what would raise it"
        return Check(name, "warn", detail, fix)
    return Check(name, "pass", detail)
