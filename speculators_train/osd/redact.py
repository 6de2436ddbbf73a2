"""Redaction of personal data and secrets in production logs, before online distillation stores anything.

**Redaction** runs before anything is written: message texts, record ids, quarantined raw lines and quarantine
reasons. Built-in rules (`RULES`, in this order), then the recipe's `osd.redact` regexes (`[REDACTED]`), then an
optional `osd.redact_hook` (str -> str):

    name           label           what it removes
    auth_header    [AUTH]          the credentials after `Authorization:` / `Proxy-Authorization:` (a header, a key
                                   `authorization=` or a JSON key), any scheme (Basic, Bearer, Digest, a bare token);
                                   the header name and the scheme word are kept
    bearer         [BEARER]        `Bearer <token of 16+ characters>` anywhere
    password       [PASSWORD]      the value after password / passwd / passphrase / pwd labels (`password=x`,
                                   `passwd: x`, `"password": "x"`, `DB_PASSWORD=x`): a quoted string or one word;
                                   the label is kept
    aws_secret     [AWS_SECRET]    the 16+ character base64 value after an AWS secret-key label (aws_secret_access_key,
                                   SecretAccessKey, secret_key, ...); the label is kept
    jwt            [JWT]           a JSON Web Token: three base64url segments, the first starting `eyJ`
    github_token   [GITHUB_TOKEN]  GitHub tokens: ghp_ / gho_ / ghu_ / ghs_ / ghr_ and github_pat_ (fine-grained)
    api_key        [API_KEY]       prefixed API keys: sk- / sk_ (OpenAI, Anthropic, Stripe), pk_ / rk_, hf_,
                                   xoxa- / xoxb- / xoxp- / xoxr- / xoxs- (Slack), glpat- (GitLab), AIza (Google)
    aws_key_id     [AWS_KEY_ID]    AWS access key ids: AKIA / ASIA / ABIA / ACCA and 16 upper-case letters or digits
    email          [EMAIL]         an e-mail address: local@domain.tld

Every built-in costs linear time in the text's length, whatever the text (no pattern can be retried from every
position of a long run): each pattern starts with a literal or a case-insensitive keyword, a run that something must
follow starts only where the run starts, and e-mails are found from their `@`. A text holding JSON escapes (`\\u0040`,
`\\/`, `\\"`, up to `UNESCAPE_LEVELS` levels deep) is also redacted in its decoded form; when that form holds more to
remove, the decoded, redacted text is what is stored. A redacted record id may be shared by several records.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass

from speculators_train.errors import UserError

UNESCAPE_LEVELS = 3


@dataclass(frozen=True)
class Rule:
    """One built-in redaction: its name, what it matches (in words), the label left in its place, and how it is found:
    regexes (a named group `keep` is kept before the label) or a function (text, label) -> text. `keywords`: lower-case
    words one of which the text must hold for the regexes to run (a cheap gate for case-insensitive patterns)."""

    name: str
    matches: str
    label: str
    patterns: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    function: Callable[[str, str], str] | None = None


# E-mails: found from each '@' that a local-part character precedes and that a domain with a 2+ letter suffix
# follows (the lookahead's run stops at the next '@', so every character is looked at a bounded number of times).
_LOCAL = "A-Za-z0-9._%+\\-"
_EMAIL_AT = re.compile(rf"(?<=[{_LOCAL}])@(?=[A-Za-z0-9.\-]+\.[A-Za-z]{{2}})")
_LOCAL_RUN = re.compile(f"[{_LOCAL}]*")
_DOMAIN_RUN = re.compile(r"[A-Za-z0-9.\-]*")
_SUFFIX = re.compile(r"\.[A-Za-z]{2,}")


def _local_start(text: str, at: int, floor: int) -> int:
    """Where the run of local-part characters that ends before `at` starts (not before `floor`). The run is scanned
    right to left in growing windows, so its cost is linear in its length."""
    size = 64
    while True:
        low = max(floor, at - size)
        window = text[low:at][::-1]
        run = _LOCAL_RUN.match(window).end()
        if run < len(window) or low == floor:
            return at - run
        size *= 4


def _redact_emails(text: str, label: str) -> str:
    """`local@domain.tld` -> label, matching what `[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\\.[A-Za-z]{2,}` matches, in linear
    time: the domain runs to the end of the last `.letters` in the run of domain characters after the '@'."""
    if "@" not in text:
        return text
    out, done = [], 0
    for at in _EMAIL_AT.finditer(text):
        if at.start() < done:
            continue
        domain_end = _DOMAIN_RUN.match(text, at.end()).end()
        end = -1
        for suffix in _SUFFIX.finditer(text, at.end() + 1, domain_end):
            end = suffix.end()
        start = _local_start(text, at.start(), done)
        if end < 0 or start == at.start():
            continue
        out += [text[done:start], label]
        done = end
    out.append(text[done:])
    return "".join(out)


_TOKEN = "A-Za-z0-9_\\-"  # base64url, and the alphabet of prefixed API keys
_VALUE = r"""(?:"[^"\n]*"?|'[^'\n]*'?|[^\s"',;&]+)"""  # a quoted string (to its closing quote) or one word
_LABEL_SEP = r"""["']?[ \t]*(?:[:=]{1,2}>?)[ \t]*"""  # `=`, `: `, `":"`, `==`, `=>`

RULES: tuple[Rule, ...] = (
    Rule(
        "auth_header",
        "the credentials after Authorization: / Proxy-Authorization: (any scheme); name and scheme kept",
        "[AUTH]",
        (rf"""(?i)(?P<keep>authorization{_LABEL_SEP}["']?(?:[A-Za-z][A-Za-z0-9\-]{{0,19}}[ \t]+)?)[^\s"',;]+""",),
        ("authorization",),
    ),
    Rule(
        "bearer",
        "Bearer <token of 16+ characters>",
        "[BEARER]",
        (r"(?i)bearer(?<![^\W_]......)\s+[A-Za-z0-9._~+/=\-]{16,}",),
        ("bearer",),
    ),
    Rule(
        "password",
        "the value after password / passwd / passphrase / pwd labels; label kept",
        "[PASSWORD]",
        (rf"(?i)(?P<keep>(?:password|passwd|passphrase|pwd){_LABEL_SEP}){_VALUE}",),
        ("pass", "pwd"),
    ),
    Rule(
        "aws_secret",
        "the base64 value (16+ characters) after an AWS secret-key label; label kept",
        "[AWS_SECRET]",
        (rf"""(?i)(?P<keep>secret[_\-.]?(?:access[_\-.]?)?key{_LABEL_SEP}["']?)[A-Za-z0-9/+=]{{16,}}""",),
        ("secret",),
    ),
    Rule(
        "jwt",
        "a JSON Web Token: three base64url segments, the first starting eyJ",
        "[JWT]",
        (rf"eyJ(?<![{_TOKEN}]...)[{_TOKEN}]{{5,}}\.[{_TOKEN}]{{5,}}\.[{_TOKEN}]*",),
    ),
    Rule(
        "github_token",
        "GitHub tokens: ghp_ gho_ ghu_ ghs_ ghr_ and github_pat_",
        "[GITHUB_TOKEN]",
        (
            r"gh[pousr]_(?<![A-Za-z0-9_]....)[A-Za-z0-9]{20,}",
            r"github_pat_(?<![A-Za-z0-9_]...........)[A-Za-z0-9_]{20,}",
        ),
    ),
    Rule(
        "api_key",
        "prefixed API keys: sk- sk_ pk_ rk_ hf_ xox?- glpat- AIza",
        "[API_KEY]",
        (
            rf"sk[-_](?<![A-Za-z0-9_]...)[{_TOKEN}]{{16,}}",
            rf"pk_(?<![A-Za-z0-9_]...)[{_TOKEN}]{{16,}}",
            rf"rk_(?<![A-Za-z0-9_]...)[{_TOKEN}]{{16,}}",
            rf"hf_(?<![A-Za-z0-9_]...)[{_TOKEN}]{{16,}}",
            rf"xox[abprs]-(?<![A-Za-z0-9_].....)[{_TOKEN}]{{16,}}",
            rf"glpat-(?<![A-Za-z0-9_]......)[{_TOKEN}]{{16,}}",
            rf"AIza(?<![A-Za-z0-9_]....)[{_TOKEN}]{{30,}}",
        ),
    ),
    Rule(
        "aws_key_id",
        "AWS access key ids: AKIA ASIA ABIA ACCA and 16 upper-case letters or digits",
        "[AWS_KEY_ID]",
        (r"(?:AKIA|ASIA|ABIA|ACCA)(?<![A-Za-z0-9]....)[A-Z0-9]{16}(?![A-Za-z0-9])",),
    ),
    Rule("email", "an e-mail address: local@domain.tld", "[EMAIL]", function=_redact_emails),
)

_ESCAPE = re.compile(
    r"\\u([dD][89abAB][0-9a-fA-F]{2})\\u([dD][c-fC-F][0-9a-fA-F]{2})"  # a surrogate pair: one character
    r'|\\u([0-9a-fA-F]{4})|\\(["\\/bfnrt])'
)
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _unescaped(match: re.Match[str]) -> str:
    high, low, code, simple = match.groups()
    if high:
        return chr(0x10000 + ((int(high, 16) - 0xD800) << 10) + int(low, 16) - 0xDC00)
    if code:
        point = int(code, 16)
        return "\ufffd" if 0xD800 <= point <= 0xDFFF else chr(point)  # a lone surrogate is no text
    return _SIMPLE_ESCAPES[simple]


def _unescape(text: str) -> str:
    """JSON string escapes decoded, one level (each escape in one left-to-right pass: linear)."""
    return _ESCAPE.sub(_unescaped, text) if "\\" in text else text


Step = Callable[[str, "str | None"], str]  # (text, text.lower() where the step's rule has keywords) -> redacted text


def _regex_step(pattern: str, label: str) -> Step:
    """Replace `pattern`'s matches by `label` (after the `keep` group, when it has one). A case-insensitive pattern
    (`(?i)` and lower-case literals) runs case-sensitively on the lowered text when the text is ASCII: the regex engine
    then skips ahead to its first literal, and lowering ASCII keeps every offset, so matches map back one to one."""
    compiled = re.compile(pattern)
    keep = "keep" in compiled.groupindex
    replacement = rf"\g<keep>{label}" if keep else label
    if not pattern.startswith("(?i)"):
        return lambda text, lowered: compiled.sub(replacement, text)
    on_lowered = re.compile(pattern.removeprefix("(?i)"))

    def step(text: str, lowered: str | None) -> str:
        if lowered is None or not text.isascii():
            return compiled.sub(replacement, text)
        out, done = [], 0
        for match in on_lowered.finditer(lowered):
            out += [text[done : match.end("keep") if keep else match.start()], label]
            done = match.end()
        return "".join([*out, text[done:]]) if out else text

    return step


class Redactor:
    """Replaces personal data and secrets before anything is stored: the built-in `RULES`, the recipe's regexes, then
    an optional `module:function` hook (str -> str). Texts are also checked with their JSON escapes decoded."""

    def __init__(self, patterns: list[str], builtin: bool = True, hook: str | None = None) -> None:
        steps: list[tuple[tuple[str, ...], Step]] = []
        for rule in RULES if builtin else ():
            if rule.function is not None:
                steps.append(((), lambda text, lowered, f=rule.function, label=rule.label: f(text, label)))
            steps += [(rule.keywords, _regex_step(pattern, rule.label)) for pattern in rule.patterns]
        for n, pattern in enumerate(patterns):
            try:
                compiled = re.compile(pattern)
            except re.error as exc:
                raise UserError(f"osd.redact[{n}]: invalid regex {pattern!r} ({exc})") from None
            steps.append(((), lambda text, lowered, p=compiled: p.sub("[REDACTED]", text)))
        self.steps = steps
        self.hook = _load_hook(hook) if hook else None

    def _apply(self, text: str) -> str:
        lowered: str | None = None
        for keywords, step in self.steps:
            if keywords:
                lowered = text.lower() if lowered is None else lowered
                if not any(word in lowered for word in keywords):
                    continue
            redacted = step(text, lowered)
            if redacted is not text:  # re.sub returns its argument itself when nothing matched
                text, lowered = redacted, None
        return text

    def __call__(self, text: str) -> str:
        result = view = self._apply(text)
        for _ in range(UNESCAPE_LEVELS):  # an escaped form (`eve\u0040example.com`) must not hide what the rules find
            decoded = _unescape(view)
            if decoded == view:
                break
            view = self._apply(decoded)
            if view != decoded:
                result = view
        return self.hook(result) if self.hook else result


def _load_hook(spec: str) -> Callable[[str], str]:
    module, _, name = spec.partition(":")
    try:
        hook = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"osd.redact_hook: cannot load {spec!r} ({exc}); expected 'module:function'") from None
    if not callable(hook):
        raise UserError(f"osd.redact_hook: {spec!r} is not callable")
    return hook
