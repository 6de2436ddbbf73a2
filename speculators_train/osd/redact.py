"""Redaction of personal data and secrets in production logs, before online distillation stores anything.

**Redaction** runs before anything is written: message texts, record ids, quarantined raw lines and quarantine
reasons. Built-in rules (`RULES`, in this order), then the recipe's `osd.redact` regexes (`[REDACTED]`), then an
optional `osd.redact_hook` (str -> str):

    name             label           what it removes
    private_key      [PRIVATE_KEY]   a private key block (PEM, OpenSSH, PGP, a service account's `private_key`) from
                                     its BEGIN line to its END line, or to the end of a text cut short
    service_token    [TOKEN]         webhook URLs (Slack, Discord, Teams) and service tokens: npm, PyPI, Docker Hub,
                                     GitLab deploy/runner, Stripe webhook, SendGrid, Shopify, Google OAuth, Square,
                                     Databricks, DigitalOcean, Telegram and Discord bots, Mailchimp, Twilio
    jwt              [JWT]           a JSON Web Token: two or three base64url segments, the first starting `eyJ`
    github_token     [GITHUB_TOKEN]  GitHub tokens: ghp_ / gho_ / ghu_ / ghs_ / ghr_ and github_pat_ (fine-grained)
    api_key          [API_KEY]       prefixed API keys: sk- / sk_ (OpenAI, Anthropic, Stripe), pk_ / rk_, hf_,
                                     xoxa- / xoxb- / xoxo- / xoxp- / xoxr- / xoxs- (Slack), glpat- (GitLab), AIza
                                     (Google), AKC (Artifactory)
    aws_key_id       [AWS_KEY_ID]    AWS access key ids: AKIA / ASIA / ABIA / ACCA / A3T? and 16 upper-case letters or
                                     digits
    url_credentials  [CREDENTIALS]   `user:password` in a URL (`postgres://user:pw@host`); scheme and host kept
    auth_header      [AUTH]          the credentials after `Authorization:` / `Proxy-Authorization:` (a header, a key
                                     `authorization=` or a JSON key), any scheme (Basic, Bearer, Digest, a bare token);
                                     the header name and the scheme word are kept
    bearer           [BEARER]        `Bearer <token of 16+ characters>` anywhere
    password         [PASSWORD]      the value after password / passwd / passphrase / pwd labels (`password=x`,
                                     `passwd: x`, `"password": "x"`, `DB_PASSWORD=x`): a quoted string or one word;
                                     the label is kept
    aws_secret       [AWS_SECRET]    the 16+ character base64 value after an AWS secret-key label
                                     (aws_secret_access_key, SecretAccessKey, secret_key, ...); the label is kept
    cookie           [COOKIE]        the value of a `Cookie:` / `Set-Cookie:` header or key, to the end of the line
    credential       [SECRET]        the value after api_key / access_token / refresh_token / id_token / auth_token /
                                     client_secret / app_secret / account_key / private_key_id / X-API-Key labels
    labelled_secret  [SECRET]        a value of 8+ characters holding a digit after any label ending in key / token /
                                     secret / pass / pwd / pw (`cloudant_key = ...`, `sl_pwd: ...`)
    email            [EMAIL]         an e-mail address: local@domain.tld
    card             [CARD]          payment card numbers: 13-19 digits (spaces or dashes between) passing Luhn
    iban             [IBAN]          IBANs passing the mod-97 check
    national_id      [NATIONAL_ID]   US social security numbers, UK National Insurance numbers
    phone            [PHONE]         phone numbers: international (`+` and 8-15 digits) and North American
    ip_address       [IP]            IPv4 addresses, and IPv6 addresses with three or more groups written

Every built-in costs linear time in the text's length, whatever the text (no pattern can be retried from every
position of a long run): each pattern starts with a literal or a case-insensitive keyword, or matches a run of
bounded length; a run that something must follow starts only where the run starts, and e-mails are found from their
`@`. A text holding JSON escapes (`\\u0040`, `\\/`, `\\"`, up to `UNESCAPE_LEVELS` levels deep) is also redacted in its
decoded form; when that form holds more to remove, the decoded, redacted text is what is stored; the same holds for
look-alike characters (full-width `＠`, invisible characters inside a token), folded by NFKC. A redacted record id
may be shared by several records.

Measured against a published rule set (`eval/bench_redact.py`: strings generated from each of detect-secrets' 24
regex detectors): recall and what the rules remove from ordinary chat are in RESULTS.md. The recipe's `osd.redact`
patterns run on RE2 (linear time whatever the pattern; no lookarounds or backreferences). A hook that raises or
returns something other than text quarantines the line without its text.
"""

from __future__ import annotations

import importlib
import ipaddress
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass

from speculators_train.errors import UserError

UNESCAPE_LEVELS = 3


@dataclass(frozen=True)
class Rule:
    """One built-in redaction: its name, what it matches (in words), the label left in its place, and how it is found:
    regexes (a named group `keep` is kept before the label) or a function (text, label) -> text. `keywords`: lower-case
    words one of which the text must hold for the regexes to run (a cheap gate for case-insensitive patterns).
    `gate`: a regex the text must match for the rule to run at all, one scan shared by every rule with the same
    gate (patterns that start with a character class are tried at every position; most texts fail the gate)."""

    name: str
    matches: str
    label: str
    patterns: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    function: Callable[[str, str], str] | None = None
    gate: str | None = None


# What the numeric rules (cards, IBANs, ids, phones, IPv4) all need: 8+ digits and separators in a row.
_NUMBERS = r"[0-9][0-9 .()\-]{6,}[0-9]"
_TOKEN_RUN = r"(?<![A-Za-z0-9_\-])[A-Za-z0-9_\-]{20}"  # what every service token holds (tried at run starts)


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


def _spans(pattern: re.Pattern[str], keep: Callable[[str], bool]) -> Callable[[str, str], str]:
    """A rule that replaces each match of `pattern` that `keep(match text)` accepts (a checksum, a range) by the
    label. Each pattern starts where a run starts (a lookbehind) and is bounded, so the scan is linear."""

    def redact(text: str, label: str) -> str:
        out, done = [], 0
        for match in pattern.finditer(text):
            if keep(match.group()):
                out += [text[done : match.start()], label]
                done = match.end()
        return "".join([*out, text[done:]]) if out else text

    return redact


def _luhn(candidate: str) -> bool:
    digits = [int(c) for c in candidate if c.isdigit()]
    if not 13 <= len(digits) <= 19:
        return False
    total = sum(d if i % 2 == 0 else (d * 2 - 9 if d > 4 else d * 2) for i, d in enumerate(reversed(digits)))
    return total % 10 == 0


def _iban(candidate: str) -> bool:
    compact = candidate.replace(" ", "")
    if not 15 <= len(compact) <= 34:
        return False
    moved = compact[4:] + compact[:4]
    return int("".join(str(int(c, 36)) for c in moved)) % 97 == 1


def _phone(candidate: str) -> bool:
    return 8 <= sum(c.isdigit() for c in candidate) <= 15


def _ipv4(candidate: str) -> bool:
    return all(int(octet) <= 255 for octet in candidate.split("."))


def _ipv6(candidate: str) -> bool:
    """An IPv6 address with at least three groups written (so `std::` and `x[1::2]` are not addresses)."""
    if candidate.count(":") < 2 or sum(1 for group in candidate.split(":") if group) < 3:
        return False
    try:
        ipaddress.IPv6Address(candidate)
    except ValueError:
        return False
    return True


_CARD = re.compile(r"(?<![0-9])[0-9](?:[ \-]?[0-9]){12,18}(?![0-9])")
_IBAN = re.compile(r"(?<![A-Za-z0-9])[A-Z]{2}[0-9]{2}(?: ?[A-Z0-9]){11,30}(?![A-Za-z0-9])")
_PHONE = re.compile(r"(?<![\w+])\+[1-9][0-9 ().\-]{6,22}[0-9](?![0-9])")
_IPV4 = re.compile(r"(?<![0-9.])(?:[0-9]{1,3}\.){3}[0-9]{1,3}(?!\.?[0-9])")
_IPV6 = re.compile(r"(?<![0-9A-Fa-f:])[0-9A-Fa-f:]{3,39}(?![0-9A-Fa-f:])")  # a run of hex digits and colons
_KEY_BEGIN = re.compile(r"(?:-----)?BEGIN[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?(?:-----)?")
_KEY_END = re.compile(r"-----END[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----")


def _redact_private_keys(text: str, label: str) -> str:
    """A PEM / OpenSSH / PGP private key block, from its BEGIN line to its END line, or to the end of the text
    when the block was cut short (a truncated log line still holds most of the key); the dashes may be missing."""
    if "PRIVATE KEY" not in text:
        return text
    out, done = [], 0
    for begin in _KEY_BEGIN.finditer(text):
        if begin.start() < done:
            continue
        end = _KEY_END.search(text, begin.end())
        out += [text[done : begin.start()], label]
        done = end.end() if end else len(text)
    return "".join([*out, text[done:]]) if out else text


_IPV4_HINT = re.compile(r"\.[0-9]{1,3}\.[0-9]{1,3}\.")  # starts with a literal: found at C speed
_IPV6_HINT = re.compile(r":[0-9A-Fa-f]{0,4}:[0-9A-Fa-f]{1,4}")


def _ip_addresses(text: str, label: str) -> str:
    """IPv4 and IPv6 addresses; the full scans (which start with a character class) run only on texts a literal-led
    hint finds something in."""
    text = _spans(_IPV4, _ipv4)(text, label) if _IPV4_HINT.search(text) else text
    return _spans(_IPV6, _ipv6)(text, label) if _IPV6_HINT.search(text) else text


def _cards(text: str, label: str) -> str:
    """13-19 digit payment card numbers (spaces or dashes between digits allowed) that pass the Luhn check; the
    longest passing span of a run is taken, so a card followed by other digits is still found."""

    def replace(match: re.Match[str]) -> str:
        span = match.group()
        for cut in [len(span), *sorted((i for i, c in enumerate(span) if c in " -"), reverse=True)]:
            if _luhn(span[:cut]):
                return label + span[cut:]
        return span

    return _CARD.sub(replace, text) if any(c.isdigit() for c in text) else text


_TOKEN = "A-Za-z0-9_\\-"  # base64url, and the alphabet of prefixed API keys
_VALUE = r"""(?:"[^"\n]*"?|'[^'\n]*'?|[^\s"',;&]+)"""  # a quoted string (to its closing quote) or one word
_LABEL_SEP = r"""["']?[ \t]*(?:[:=]{1,2}>?)[ \t]*"""  # `=`, `: `, `":"`, `==`, `=>`
_UNLABELLED = r"(?!\[[A-Za-z_]+\])"  # a value an earlier rule replaced by its label is left as it is

RULES: tuple[Rule, ...] = (
    Rule(
        "private_key",
        "a private key block (PEM, OpenSSH, PGP, a service account's private_key), BEGIN to END or to the end",
        "[PRIVATE_KEY]",
        function=_redact_private_keys,
    ),
    Rule(
        "service_token",
        "webhook URLs (Slack, Discord, Teams) and service tokens (npm, PyPI, Docker Hub, GitLab deploy/runner, "
        "Stripe webhook, SendGrid, Shopify, Google OAuth, Square, Databricks, DigitalOcean, Telegram and Discord bots, "
        "GitLab runner registration, Mailchimp, Twilio)",
        "[TOKEN]",
        (
            r"hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9_/\-]{8,}",
            r"discord(?:app)?\.com/api/webhooks/[0-9]{5,30}/[A-Za-z0-9_\-]{20,}",
            r"webhook\.office\.com/webhookb2/[^\s\"'<>]{16,}",
            r"npm_(?<![A-Za-z0-9_]....)[A-Za-z0-9]{36}",
            r"pypi-AgE(?<![A-Za-z0-9_]........)[A-Za-z0-9_\-]{50,}",
            r"dckr_pat_(?<![A-Za-z0-9_].........)[A-Za-z0-9_\-]{20,}",
            r"gl(?:dt|rt|cbt|ptt|ft|soat|imt)-(?<![A-Za-z0-9_]gl....-)[A-Za-z0-9_\-]{20,}",
            r"whsec_(?<![A-Za-z0-9_]......)[A-Za-z0-9]{24,}",
            r"SG\.(?<![A-Za-z0-9_]...)[A-Za-z0-9_\-]{22}\.[A-Za-z0-9_\-]{43}",
            r"shp(?:at|ca|pa|ss)_[a-fA-F0-9]{32}",
            r"ya29\.(?<![A-Za-z0-9_].....)[A-Za-z0-9_\-]{20,}",
            r"sq0(?:atp|csp)-[A-Za-z0-9_\-]{22,}",
            r"dapi(?<![A-Za-z0-9_]....)[a-f0-9]{32}",
            r"do[por]_v1_[a-f0-9]{64}",
            r"(?<![0-9])[0-9]{8,10}:[A-Za-z0-9_\-]{35}(?![A-Za-z0-9_\-])",
            r"GR1348941[A-Za-z0-9_\-]{20,}",
            r"(?<![A-Za-z0-9_\-])[MNO][A-Za-z0-9_\-]{23,25}\.[A-Za-z0-9_\-]{6}\.[A-Za-z0-9_\-]{27}",
            r"(?<![0-9a-z])[0-9a-z]{32}-us[0-9]{1,2}(?![0-9])",
            r"(?<![A-Za-z0-9])(?:AC|SK)[a-z0-9]{32}(?![A-Za-z0-9])",
        ),
        gate=_TOKEN_RUN,
    ),
    Rule(
        "jwt",
        "a JSON Web Token: two or three base64url segments, the first starting eyJ",
        "[JWT]",
        (rf"eyJ(?<![{_TOKEN}]...)[{_TOKEN}=]{{2,}}\.[{_TOKEN}=]{{4,}}(?:\.[{_TOKEN}.+/=]*)?",),
    ),
    Rule(
        "github_token",
        "GitHub tokens: ghp_ gho_ ghu_ ghs_ ghr_ and github_pat_",
        "[GITHUB_TOKEN]",
        (
            r"gh[pousr]_(?<![A-Za-z0-9_]....)[A-Za-z0-9_]{20,}",
            r"github_pat_(?<![A-Za-z0-9_]...........)[A-Za-z0-9_]{20,}",
        ),
    ),
    Rule(
        "api_key",
        "prefixed API keys: sk- sk_ pk_ rk_ hf_ xox?- glpat- AIza AKC",
        "[API_KEY]",
        (
            rf"sk[-_](?<![A-Za-z0-9_]...)[{_TOKEN}]{{16,}}",
            rf"pk_(?<![A-Za-z0-9_]...)[{_TOKEN}]{{16,}}",
            rf"rk_(?<![A-Za-z0-9_]...)[{_TOKEN}]{{16,}}",
            rf"hf_(?<![A-Za-z0-9_]...)[{_TOKEN}]{{16,}}",
            rf"xox[abposr]-(?<![A-Za-z0-9_].....)[{_TOKEN}]{{16,}}",
            rf"glpat-(?<![A-Za-z0-9_]......)[{_TOKEN}]{{16,}}",
            rf"AIza(?<![A-Za-z0-9_]....)[{_TOKEN}]{{30,}}",
            r"AKC(?<![A-Za-z0-9_]...)[A-Za-z0-9]{10,}",
        ),
    ),
    Rule(
        "aws_key_id",
        "AWS access key ids: AKIA ASIA ABIA ACCA A3T? and 16 upper-case letters or digits",
        "[AWS_KEY_ID]",
        (r"(?:AKIA|ASIA|ABIA|ACCA|A3T[A-Z0-9])(?<![A-Za-z0-9]....)[A-Z0-9]{16}(?![A-Za-z0-9])",),
    ),
    Rule(
        "url_credentials",
        "user:password in a URL (scheme://user:password@host); scheme and host kept",
        "[CREDENTIALS]",
        (r"""(?P<keep>://)[^\s:/?#@"'<>]{0,256}:[^\s/?#@"'<>]{1,256}(?=@)""",),
    ),
    Rule(
        "auth_header",
        "the credentials after Authorization: / Proxy-Authorization: (any scheme); name and scheme kept",
        "[AUTH]",
        (
            rf"""(?i)(?P<keep>authorization{_LABEL_SEP}["']?(?:[A-Za-z][A-Za-z0-9\-]{{0,19}}[ \t]+)?)"""
            rf"""{_UNLABELLED}[^\s"',;]+""",
        ),
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
        (rf"(?i)(?P<keep>(?:password|passwd|passphrase|pwd){_LABEL_SEP}){_UNLABELLED}{_VALUE}",),
        ("pass", "pwd"),
    ),
    Rule(
        "aws_secret",
        "the base64 value (16+ characters) after an AWS secret-key label; label kept",
        "[AWS_SECRET]",
        (rf"""(?i)(?P<keep>secret[_\-.]?(?:access[_\-.]?)?key{_LABEL_SEP}["']?){_UNLABELLED}[A-Za-z0-9/+=]{{16,}}""",),
        ("secret",),
    ),
    Rule(
        "cookie",
        "the value of a Cookie: / Set-Cookie: header or key, to the end of the line; the name kept",
        "[COOKIE]",
        (rf"""(?i)(?P<keep>cookie["']?[ \t]*[:=][ \t]*["']?){_UNLABELLED}[^\r\n"']+""",),
        ("cookie",),
    ),
    Rule(
        "credential",
        "the value after api_key / apikey / access_token / refresh_token / id_token / auth_token / client_secret / "
        "app_secret / secret_token / session_token / account_key / private_key_id / X-API-Key labels; label kept",
        "[SECRET]",
        (
            r"(?i)(?P<keep>(?:api[_\-]?key|(?:access|refresh|id|auth|secret|session|sas)[_\-]?token|"
            rf"(?:client|app)[_\-]?secret|account[_\-]?key|private[_\-]?key[_\-]?id){_LABEL_SEP})"
            + _UNLABELLED
            + _VALUE,
        ),
        ("key", "token", "secret"),
    ),
    Rule(
        "labelled_secret",
        "a value of 8+ characters holding a digit after any label ending in key / token / secret / pass / pwd / pw "
        "(cloudant_key = ..., sl_pwd: ...); label kept",
        "[SECRET]",
        (
            r"(?i)(?P<keep>(?:key|token|secret|pass(?:word)?|pwd|pw)[\"'\]]{0,2}"
            r"[ \t]{0,64}[:=]{1,2}>?[ \t]{0,64}[\"']?)(?!\[)(?=[^\s\"',;&]{0,256}?[0-9])[^\s\"',;&]{8,256}",
        ),
        ("key", "token", "secret", "pass", "pw"),
    ),
    Rule("email", "an e-mail address: local@domain.tld", "[EMAIL]", function=_redact_emails),
    Rule(
        "card",
        "payment card numbers: 13-19 digits (spaces, dashes) passing Luhn",
        "[CARD]",
        function=_cards,
        gate=_NUMBERS,
    ),
    Rule("iban", "IBANs passing the mod-97 check", "[IBAN]", function=_spans(_IBAN, _iban), gate=_NUMBERS),
    Rule(
        "national_id",
        "US social security numbers (123-45-6789) and UK National Insurance numbers (AB 12 34 56 C)",
        "[NATIONAL_ID]",
        (
            r"(?<![0-9\-])(?!000|666|9)[0-9]{3}-(?!00)[0-9]{2}-(?!0000)[0-9]{4}(?![0-9\-])",
            r"(?<![A-Za-z0-9])[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z] ?[0-9]{2} ?[0-9]{2} ?[0-9]{2} ?[A-D](?![A-Za-z0-9])",
        ),
        gate=_NUMBERS,
    ),
    Rule(
        "phone",
        "phone numbers: international (+ and 8-15 digits) and North American ((555) 123-4567, 555-123-4567)",
        "[PHONE]",
        (r"(?<![0-9\-.])\(?[2-9][0-9]{2}\)?[ .\-][0-9]{3}[ .\-][0-9]{4}(?![0-9\-]|\.[0-9])",),
        function=_spans(_PHONE, _phone),
        gate=_NUMBERS,
    ),
    Rule("ip_address", "IPv4 addresses, and IPv6 addresses of three or more groups", "[IP]", function=_ip_addresses),
)
_GATES = {rule.gate: re.compile(rule.gate) for rule in RULES if rule.gate is not None}

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


class RedactionFailed(Exception):
    """The recipe's redact hook raised or returned something other than text: the line is quarantined without it."""


# Characters that render as nothing: inside a secret they hide it from every pattern.
_INVISIBLE = dict.fromkeys(map(ord, "\u00ad\u180e\u200b\u200c\u200d\u200e\u200f\u2060\u2061\u2062\u2063\u2064\ufeff"))


def _fold(text: str) -> str:
    """Look-alike characters folded to what they stand for (NFKC: full-width `＠` is `@`, `ｓｋ-` is `sk-`) and
    invisible characters removed. ASCII text is returned as it is."""
    if text.isascii():
        return text
    return unicodedata.normalize("NFKC", text).translate(_INVISIBLE)


def _user_pattern(n: int, pattern: str) -> Callable[[str], str]:
    """A recipe's `osd.redact` pattern, run on RE2 (linear time in the text, whatever the pattern: a pattern with
    nested quantifiers cannot hang ingestion), or refused with the reason."""
    import re2

    options = re2.Options()
    options.log_errors = False
    try:
        compiled = re2.compile(pattern, options)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        raise UserError(
            f"osd.redact[{n}]: {pattern!r} is not an RE2 regex ({reason}); user patterns run on RE2, which takes "
            "linear time on any text and has no lookarounds or backreferences"
        ) from None
    return lambda text: compiled.sub("[REDACTED]", text)


class Redactor:
    """Replaces personal data and secrets before anything is stored: the built-in `RULES`, the recipe's regexes, then
    an optional `module:function` hook (str -> str). Texts are also checked with their JSON escapes decoded and
    their look-alike characters folded."""

    def __init__(self, patterns: list[str], builtin: bool = True, hook: str | None = None) -> None:
        steps: list[tuple[tuple[str, ...], str | None, Step]] = []
        for rule in RULES if builtin else ():
            if rule.function is not None:
                steps.append(((), rule.gate, lambda text, lowered, f=rule.function, label=rule.label: f(text, label)))
            steps += [(rule.keywords, rule.gate, _regex_step(pattern, rule.label)) for pattern in rule.patterns]
        for n, pattern in enumerate(patterns):
            sub = _user_pattern(n, pattern)
            steps.append(((), None, lambda text, lowered, sub=sub: sub(text)))
        self.steps = steps
        self.hook = _load_hook(hook) if hook else None

    def _apply(self, text: str) -> str:
        lowered: str | None = None
        gates: dict[str, bool] = {}  # each gate scanned once per text version
        for keywords, gate, step in self.steps:
            if gate is not None:
                if gate not in gates:
                    gates[gate] = _GATES[gate].search(text) is not None
                if not gates[gate]:
                    continue
            if keywords:
                lowered = text.lower() if lowered is None else lowered
                if not any(word in lowered for word in keywords):
                    continue
            redacted = step(text, lowered)
            if redacted is not text:  # re.sub returns its argument itself when nothing matched
                text, lowered, gates = redacted, None, {}
        return text

    def without_hook(self, text: str) -> str:
        """The rules and the recipe's patterns over every decoded form of `text`; what is stored when the decoded
        form holds more to remove is that form, redacted."""
        result = view = self._apply(text)
        for _ in range(UNESCAPE_LEVELS):  # an escaped form (`eve\u0040example.com`) must not hide what the rules find
            decoded = _fold(_unescape(view))
            if decoded == view:
                break
            view = self._apply(decoded)
            if view != decoded:
                result = view
        return result

    def __call__(self, text: str) -> str:
        result = self.without_hook(text)
        if self.hook is None:
            return result
        try:
            hooked = self.hook(result)
        except Exception as exc:  # the user's code: any failure quarantines the line, never stores it as it was
            raise RedactionFailed(f"osd.redact_hook raised {type(exc).__name__}") from None
        if not isinstance(hooked, str):
            raise RedactionFailed(f"osd.redact_hook returned {type(hooked).__name__}, not text")
        return hooked


def _load_hook(spec: str) -> Callable[[str], str]:
    module, _, name = spec.partition(":")
    try:
        hook = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"osd.redact_hook: cannot load {spec!r} ({exc}); expected 'module:function'") from None
    if not callable(hook):
        raise UserError(f"osd.redact_hook: {spec!r} is not callable")
    return hook
