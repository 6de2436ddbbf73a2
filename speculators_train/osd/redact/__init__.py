"""Redaction of personal data and secrets in production logs, before online distillation stores anything.

**Redaction** runs before anything is written: message texts, record ids, quarantined raw lines and quarantine
reasons. Built-in rules (`RULES` in `rules.py`, in this order), then the recipe's `osd.redact` regexes
(`[REDACTED]`), then an optional `osd.redact_hook` (str -> str):

    name             label             what it removes
    private_key      [PRIVATE_KEY]     a private key block (PEM, OpenSSH, PGP, a service account's `private_key`) from
                                       its BEGIN line (whose words a wrap may split) to its END line, or to the end of
                                       a text cut short; an END line's base64 lines when the BEGIN is missing; a PuTTY
                                       key file; a DER or OpenSSH key body with no header at all
    service_token    [TOKEN]           webhook URLs (Slack, Discord, Teams) and service tokens: npm, PyPI, Docker Hub,
                                       GitLab (glpat/gldt/glrt/glagent/...), Stripe webhook, SendGrid, Shopify, Google
                                       OAuth (ya29.) and refresh tokens (1//0), Square, Databricks, DigitalOcean,
                                       Telegram and Discord bots, Mailchimp, Twilio, Artifactory (AP..)
    jwt              [JWT]             a JSON Web Token: two or three base64url segments, the first starting `eyJ`
    github_token     [GITHUB_TOKEN]    GitHub tokens: ghp_ / gho_ / ghu_ / ghs_ / ghr_ and github_pat_ (fine-grained)
    api_key          [API_KEY]         prefixed API keys: sk- / sk_ (OpenAI, Anthropic, Stripe), pk_ / rk_, hf_,
                                       xoxa- / xoxb- / xoxe- / xoxo- / xoxp- / xoxr- / xoxs- / xapp- (Slack), glpat-
                                       (GitLab), AIza (Google), AKC (Artifactory)
    aws_key_id       [AWS_KEY_ID]      AWS access key ids: AKIA / ASIA / ABIA / ACCA / A3T? and 16 upper-case letters or
                                       digits
    signed_url       [SIGNATURE]       the signature and credential parameters of a signed URL: X-Amz-Signature /
                                       -Credential / -Security-Token (S3), X-Goog-Signature (GCS), sig (Azure SAS),
                                       signature, token, access_token, api_key, client_secret, code; the name is kept
    url_credentials  [CREDENTIALS]     `user:password` in a URL (`postgres://user:pw@host`); scheme and host kept
    auth_header      [AUTH]            the credentials after `Authorization:` / `Proxy-Authorization:` (a header, a key
                                       `authorization=` or a JSON key), any scheme (Basic, Bearer, Digest, a bare
                                       token); the header name and the scheme word are kept
    bearer           [BEARER]          `Bearer <token of 16+ characters>` anywhere
    cli_password     [PASSWORD]        a command line's password, token or key option: `--password X`,
                                       `--db-password=X`, `-storepass X`, `--api-key X`, `sshpass -p X`, `mysql -pX`,
                                       `curl -u user:X` (not `$VAR`, `<placeholder>`); the option is kept
    config_password  [PASSWORD]        a `.netrc` entry's password (`machine h login u password X`, across lines) and
                                       a `.pgpass` line's (`host:port:db:user:X`); the rest is kept
    password         [PASSWORD]        the value after password / passwd / passphrase / passcode / pwd / pass labels
                                       (`password=x`, `passwd: x`, `"pass": "x"`, `DB_PASSWORD=x`): a quoted string
                                       or one word; the label is kept
    password_prose   [PASSWORD]        a password told in prose: `my password is X`, `the passcode for the router was
                                       'X'`, `password set to X`: a quoted value, or a word holding a digit or a symbol
    aws_secret       [AWS_SECRET]      the 16+ character base64 value after an AWS secret-key label
                                       (aws_secret_access_key, SecretAccessKey, secret_key, ...), and a quoted
                                       40-character secret after `aws ... key` on one line; the label is kept
    cookie           [COOKIE]          the value of a `Cookie:` / `Set-Cookie:` header or key, to the end of the line
    env_secret       [SECRET]          the value of a `.env` / shell assignment whose upper-case name ends in SECRET,
                                       TOKEN, KEY, PASS, PASSWORD, PWD, CREDENTIALS or AUTH (`export GITHUB_TOKEN=x`)
    credential       [SECRET]          the value after api_key / access_token / refresh_token / id_token / auth_token /
                                       client_secret / app_secret / account_key / private_key_id / client-key-data
                                       (kubeconfig) / X-API-Key labels, and a registry's `"auth"` / `"identitytoken"`
                                       (docker config.json)
    labelled_secret  [SECRET]          a value of 8+ characters holding a digit, or of 32+, after a label ending in
                                       key / token / secret / pass / pwd / pw (`cloudant_key = ...`, `sl_pwd: ...`),
                                       also in config scanners' keyword forms (`'cl-apikey'   "..."`) and after
                                       vendor labels
    encoded          [ENCODED_SECRET]  a base64 / base64url run of 24+ characters whose decoded text holds anything the
                                       rules remove (an encoded private key, a kubeconfig's client-key-data)
    email            [EMAIL]           an e-mail address: local@domain.tld
    card             [CARD]            payment card numbers: 13-19 digits (spaces or dashes between) passing Luhn
    iban             [IBAN]            IBANs passing the mod-97 check
    national_id      [NATIONAL_ID]     US social security numbers, UK National Insurance numbers
    phone            [PHONE]           phone numbers: international (`+` and 8-15 digits) and North American
    ip_address       [IP]              IPv4 addresses, and IPv6 addresses with three or more groups written

No rule caps a value's length: a labelled token is removed to its end, however long.

**Decoded forms.** A text is also redacted in its decoded form: JSON escapes (`\\u0040`, `\\/`, `\\"`), percent
escapes (`password%3Dx`), HTML entities (`&quot;password&quot;`), look-alike characters folded (NFKC: full-width
`＠` is `@`; Cyrillic and Greek letters that look like Latin ones, `раssword`, `ѕk-`; invisible characters inside a
token removed), up to `DECODE_LEVELS` levels deep; when the decoded form holds more to remove, the decoded, redacted
text is what is stored. Base64 payloads are decoded by the `encoded` rule, to the same depth. A redacted record id may
be shared by several records.

**Cost.** Each rule has an RE2 trigger (`rules.py`): every text is scanned once for all triggers, and only the rules
whose trigger it holds run; most chat holds none. Every built-in costs linear time in the text's length, whatever the
text. Measured against a published rule set (`eval/bench_redact.py`: strings generated from each of detect-secrets'
24 regex detectors, and this toolkit's own forms): recall, what the rules remove from ordinary chat and throughput are
in RESULTS.md. The recipe's `osd.redact` patterns run on RE2 (linear time whatever the pattern; no lookarounds or
backreferences). A hook that raises or returns something other than text quarantines the line without its text.
"""

from __future__ import annotations

import html
import importlib
import re
import unicodedata
from collections.abc import Callable
from urllib.parse import unquote

import re2

from speculators_train.errors import UserError
from speculators_train.osd.redact.rules import RULES, Rule

__all__ = ["DECODE_LEVELS", "RULES", "RedactionFailed", "Redactor", "Rule"]

DECODE_LEVELS = 3

_ESCAPE = re.compile(
    r"\\u([dD][89abAB][0-9a-fA-F]{2})\\u([dD][c-fC-F][0-9a-fA-F]{2})"  # a surrogate pair: one character
    r'|\\u([0-9a-fA-F]{4})|\\(["\\/bfnrt])'
)
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_PERCENT = re.compile(r"%[0-9A-Fa-f]{2}")
_ENTITY = re.compile(r"&(?:#[0-9]{1,7}|#[xX][0-9A-Fa-f]{1,6}|[A-Za-z][A-Za-z0-9]{1,31});")


def _unescaped(match: re.Match[str]) -> str:
    high, low, code, simple = match.groups()
    if high:
        return chr(0x10000 + ((int(high, 16) - 0xD800) << 10) + int(low, 16) - 0xDC00)
    if code:
        point = int(code, 16)
        return "\ufffd" if 0xD800 <= point <= 0xDFFF else chr(point)  # a lone surrogate is no text
    return _SIMPLE_ESCAPES[simple]


# Characters that render as nothing: inside a secret they hide it from every pattern.
_INVISIBLE = dict.fromkeys(map(ord, "\u00ad\u180e\u200b\u200c\u200d\u200e\u200f\u2060\u2061\u2062\u2063\u2064\ufeff"))
# Cyrillic and Greek letters that Unicode's confusables list maps to one Latin letter (after NFKC): a label spelled
# with them (`раssword`, Cyrillic р and а) reads as the label.
_CONFUSABLES = str.maketrans(
    "аеорсухіјѕԁԛԝһӏвкмнтАВЕКМНОРСТХІЈЅҮԚԜαοροντυικχΑΒΕΖΗΙΚΜΝΟΡΤΥΧ",
    "aeopcyxijsdqwhlbkmhtABEKMHOPCTXIJSYQWaopovtuikxABEZHIKMNOPTYX",
)
_FOLD = _INVISIBLE | _CONFUSABLES
_FOLDABLE = re.compile("[" + "".join(map(chr, _FOLD)) + "]")


def _decode(text: str) -> str:
    """One level of every encoding that can hide a secret from the rules: JSON escapes, percent escapes, HTML
    entities, look-alike and invisible characters. Each pass is linear; a text holding none is returned as it is."""
    if "\\" in text:
        text = _ESCAPE.sub(_unescaped, text)
    if "%" in text and _PERCENT.search(text):
        text = unquote(text, errors="replace")
    if "&" in text and _ENTITY.search(text):
        text = html.unescape(text)
    if not text.isascii():
        text = unicodedata.normalize("NFKC", text)
        text = text.translate(_FOLD) if _FOLDABLE.search(text) else text  # a translation looks up every character
    return text


Step = Callable[[str, "str | None"], str]  # (text, text.lower() for a case-insensitive step) -> redacted text


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


def _re2_options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False
    options.max_mem = 64 << 20
    return options


class _Triggers:
    """Which rules a text could need. One RE2 search for all triggers together decides whether any applies (most chat
    holds none; it also falls back from RE2's DFA to its NFA where the DFA runs out of memory). When one does, a text
    of up to `SET_BYTES` is scanned once by a Set of every trigger, a longer one by each rule's trigger in turn (each
    search stops at its first match): the Set's combined automaton must scan to the end and grows on random base64
    until it takes seconds per megabyte."""

    SET_BYTES = 16 << 10

    def __init__(self, rules: tuple[Rule, ...]) -> None:
        options = _re2_options()
        self.any = re2.compile("|".join(f"(?:{rule.trigger})" for rule in rules), options) if rules else None
        self.each = [re2.compile(rule.trigger, options) for rule in rules]
        self.set = re2.Set.SearchSet(options)
        for rule in rules:
            self.set.Add(rule.trigger)
        self.set.Compile()

    def __call__(self, text: str) -> list[int]:
        if self.any is None:
            return []
        raw = text.encode("utf-8", "surrogatepass")  # a lone surrogate (JSON allows one) is no reason to fail
        if self.any.search(raw) is None:
            return []
        hits = self.set.Match(raw) if len(raw) <= self.SET_BYTES else None  # None too where the Set ran out of memory
        if hits:
            return sorted(hits)
        return [index for index, trigger in enumerate(self.each) if trigger.search(raw) is not None]


class Redactor:
    """Replaces personal data and secrets before anything is stored: the built-in `RULES`, the recipe's regexes, then
    an optional `module:function` hook (str -> str). Texts are also redacted in their decoded forms. One redactor per
    thread: it counts how deep it is inside decoded payloads."""

    def __init__(self, patterns: list[str], builtin: bool = True, hook: str | None = None) -> None:
        self.rules = RULES if builtin else ()
        self.triggers = _Triggers(self.rules)
        self.steps: list[list[Step]] = []
        for rule in self.rules:
            self.steps.append([_regex_step(pattern, rule.label) for pattern in rule.patterns])
            if rule.function is not None:
                function, label = rule.function, rule.label
                if rule.nested:
                    self.steps[-1].append(lambda text, lowered, f=function, label=label: f(text, label, self._nested))
                else:
                    self.steps[-1].append(lambda text, lowered, f=function, label=label: f(text, label))
        self.user = [_user_pattern(n, pattern) for n, pattern in enumerate(patterns)]
        self.hook = _load_hook(hook) if hook else None
        self._depth = 0

    def _apply(self, text: str) -> str:
        """The triggered rules, then the recipe's patterns, over `text` as it is."""
        for index in self.triggers(text):
            lowered: str | None = None
            for step in self.steps[index]:
                if lowered is None and text.isascii():
                    lowered = text.lower()
                redacted = step(text, lowered)
                if redacted is not text:  # re.sub returns its argument itself when nothing matched
                    text, lowered = redacted, None
        for sub in self.user:
            text = sub(text)
        return text

    def _nested(self, payload: str) -> str:
        """Every rule over a decoded payload, to `DECODE_LEVELS` levels of payloads inside payloads."""
        if self._depth >= DECODE_LEVELS:
            return payload
        self._depth += 1
        try:
            return self.without_hook(payload)
        finally:
            self._depth -= 1

    def without_hook(self, text: str) -> str:
        """The rules and the recipe's patterns over every decoded form of `text`; what is stored when the decoded
        form holds more to remove is that form, redacted."""
        result = view = self._apply(text)
        for _ in range(DECODE_LEVELS):
            decoded = _decode(view)
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


def _user_pattern(n: int, pattern: str) -> Callable[[str], str]:
    """A recipe's `osd.redact` pattern, run on RE2 (linear time in the text, whatever the pattern: a pattern with
    nested quantifiers cannot hang ingestion), or refused with the reason."""
    try:
        compiled = re2.compile(pattern, _re2_options())
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        raise UserError(
            f"osd.redact[{n}]: {pattern!r} is not an RE2 regex ({reason}); user patterns run on RE2, which takes "
            "linear time on any text and has no lookarounds or backreferences"
        ) from None

    def sub(text: str) -> str:
        # as bytes: a lone surrogate (JSON allows one) cannot be encoded strictly, and is no reason to fail
        raw = compiled.sub(b"[REDACTED]", text.encode("utf-8", "surrogatepass"))
        return raw.decode("utf-8", "surrogatepass")

    return sub


class RedactionFailed(Exception):
    """The recipe's redact hook raised or returned something other than text: the line is quarantined without it."""


def _load_hook(spec: str) -> Callable[[str], str]:
    module, _, name = spec.partition(":")
    try:
        hook = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"osd.redact_hook: cannot load {spec!r} ({exc}); expected 'module:function'") from None
    if not callable(hook):
        raise UserError(f"osd.redact_hook: {spec!r} is not callable")
    return hook
