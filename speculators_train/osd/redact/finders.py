"""The functions behind the redaction rules that a regex alone cannot express: a checksum (cards, IBANs), a range
(IP addresses), a scan from a fixed point (e-mails from their `@`, key bodies back from an END line) or a decoding
(base64 payloads). Each takes linear time in the text's length."""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from collections.abc import Callable

Redact = Callable[[str], str]  # the whole rule set, for a finder that redacts what it decodes


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


def emails(text: str, label: str) -> str:
    """`local@domain.tld` -> label, matching what `[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\\.[A-Za-z]{2,}` matches, in linear
    time: the domain runs to the end of the last `.letters` in the run of domain characters after the '@'."""
    out, done = [], 0
    for at in _EMAIL_AT.finditer(text):
        if at.start() < done:
            continue
        domain_end = _DOMAIN_RUN.match(text, at.end()).end()
        end = -1
        for suffix in _SUFFIX.finditer(text, at.end() + 1, domain_end):
            end = suffix.end()
        start = _local_start(text, at.start(), done)
        if end < 0 or start == at.start() or _scp_address(text, end):
            continue
        out += [text[done:start], label]
        done = end
    out.append(text[done:])
    return "".join(out)


def _scp_address(text: str, end: int) -> bool:
    """`user@host` followed by `:path` with no space (`git@github.com:org/repo.git`, scp's `user@host:file`): an
    address of a repository or a file, which names no mailbox."""
    return text[end : end + 1] == ":" and end + 1 < len(text) and not text[end + 1].isspace()


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
    """A payment card number: 13-19 digits passing Luhn, starting with an issuer's digit (2-6: Mastercard, Amex,
    Diners, JCB, Visa, Discover, UnionPay), so a digit run that passes by chance (one in ten do) is less often taken."""
    digits = [int(c) for c in candidate if c.isdigit()]
    if not 13 <= len(digits) <= 19 or not 2 <= digits[0] <= 6:
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
    """An IPv4 address that names a host: not the loopback or the unspecified address (127.0.0.1, 0.0.0.0)."""
    octets = [int(octet) for octet in candidate.split(".")]
    return all(octet <= 255 for octet in octets) and octets[0] not in (0, 127)


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
# Not after what writes a version number (`v1.2.3.4`, `version 10.0.0.1`, `pkg==1.2.3.4`, `build 4.0.1.2`)
_VERSIONED = "".join(
    f"(?<!{before})" for before in ("[vV]", "[vV]ersion ", "[vV]ersion: ", "==", "~=", ">=", "<=", "[bB]uild ",
                                    "[rR]elease ", "[vV]er\\. ")
)  # fmt: skip
_IPV4 = re.compile(rf"(?<![0-9.]){_VERSIONED}(?:[0-9]{{1,3}}\.){{3}}[0-9]{{1,3}}(?!\.?[0-9])")
_IPV6 = re.compile(r"(?<![0-9A-Fa-f:])[0-9A-Fa-f:]{3,39}(?![0-9A-Fa-f:])")  # a run of hex digits and colons

# Private keys: a header whose words a wrap may split, a PuTTY key file, or a body without its header (the DER
# prefixes of PKCS#1 / PKCS#8 / SEC1 / Ed25519 private keys and OpenSSH's `openssh-key-v1`, never a certificate's or
# a public key's), whose base64 lines run on.
_KEY_BEGIN = re.compile(r"(?:-{3,5})?BEGIN[A-Z0-9\s]{0,40}PRIVATE\s{1,4}KEY(?: BLOCK)?(?:-{3,5})?")
_KEY_END = re.compile(r"-{3,5}END[A-Z0-9\s]{0,40}PRIVATE\s{1,4}KEY(?: BLOCK)?-{0,5}")
_PUTTY = re.compile(
    r"PuTTY-User-Key-File-[0-9]+(?::[^\n]*)?(?:\r?\n(?:[A-Za-z][A-Za-z\-]{0,31}:[^\n]*|[A-Za-z0-9+/=]+))*"
)
KEY_BODY_PREFIX = r"(?:MII[A-Za-z0-9+/]{3}IBA[AD]|MIG[A-Za-z0-9+/]AgEA|MHcCAQEE|MC4CAQAw|b3BlbnNzaC1rZXktdjE)"
_KEY_BODY = re.compile(
    rf"(?<![A-Za-z0-9+/]){KEY_BODY_PREFIX}[A-Za-z0-9+/=]*(?:[ \t]*(?:\r?\n|\\n)[ \t]*[A-Za-z0-9+/=]{{4,}})*"
)
_BASE64_LINE = re.compile(r"[A-Za-z0-9+/=]+")


def _body_start(text: str, end: int, floor: int) -> int:
    """Where the base64 lines that end at `end` (an END line with no BEGIN) start: lines are walked back one by one
    while they are base64 or blank, never before `floor`."""
    start = end
    while start > floor:
        cut = max(text.rfind("\n", floor, start - 1), floor - 1)
        line = text[cut + 1 : start].strip()
        if line and not _BASE64_LINE.fullmatch(line):
            break
        start = cut + 1
    return start


def private_keys(text: str, label: str) -> str:
    """A PEM / OpenSSH / PGP private key block from its BEGIN line to its END line, or to the end of the text when the
    block was cut short; an END line with no BEGIN takes the base64 lines before it; a PuTTY key file to its last
    line; a key body without header or footer."""
    blocks: list[tuple[int, int]] = []  # BEGIN..END blocks: sorted and disjoint
    for begin in _KEY_BEGIN.finditer(text):
        if not blocks or begin.start() >= blocks[-1][1]:
            end = _KEY_END.search(text, begin.end())
            blocks.append((begin.start(), end.end() if end else len(text)))
    spans, floor, i = list(blocks), 0, 0
    for end in _KEY_END.finditer(text):
        while i < len(blocks) and blocks[i][1] <= end.start():
            floor, i = max(floor, blocks[i][1]), i + 1
        if i < len(blocks) and blocks[i][0] <= end.start():
            continue  # the END of a block
        spans.append((_body_start(text, end.start(), floor), end.end()))
        floor = end.end()
    spans += [m.span() for pattern in (_PUTTY, _KEY_BODY) for m in pattern.finditer(text)]
    if not spans:
        return text
    out, done = [], 0
    for start, end in sorted(spans):
        if end <= done:
            continue
        out += [text[done : max(start, done)], label]
        done = end
    return "".join([*out, text[done:]])


# Base64 payloads: a run long enough to hold a secret, decoded when it is printable text, and redacted through every
# rule (the runs decoded at one level hold fewer characters than the text, and nesting is bounded by the caller).
_BASE64_RUN = re.compile(r"(?<![A-Za-z0-9+/_\-])[A-Za-z0-9+/_\-]{24,}={0,2}")
_NOT_TEXT = re.compile(r"[^\x20-\x7e\t\r\n]")


def _decoded(run: str) -> str | None:
    """A base64 (or base64url) run's payload when it is printable ASCII text, else None."""
    body = run.rstrip("=")
    url = "-" in body or "_" in body
    if (url and ("+" in body or "/" in body)) or len(body) % 4 == 1:
        return None
    try:
        raw = base64.b64decode(body + "=" * (-len(body) % 4), altchars=b"-_" if url else None, validate=True)
        payload = raw.decode("ascii")
    except (binascii.Error, ValueError):
        return None
    return None if _NOT_TEXT.search(payload) else payload


def encoded(text: str, label: str, redact: Redact) -> str:
    """Each base64 run whose decoded text holds something the rules remove is replaced by the label."""
    out, done = [], 0
    for match in _BASE64_RUN.finditer(text):
        payload = _decoded(match.group())
        if payload is not None and redact(payload) != payload:
            out += [text[done : match.start()], label]
            done = match.end()
    return "".join([*out, text[done:]]) if out else text


_IPV4_HINT = re.compile(r"\.[0-9]{1,3}\.[0-9]{1,3}\.")  # starts with a literal: found at C speed
_IPV6_HINT = re.compile(r":[0-9A-Fa-f]{0,4}:[0-9A-Fa-f]{1,4}")


def ip_addresses(text: str, label: str) -> str:
    """IPv4 and IPv6 addresses; each full scan (which starts with a character class) runs only where a literal-led
    hint finds something."""
    text = _spans(_IPV4, _ipv4)(text, label) if _IPV4_HINT.search(text) else text
    return _spans(_IPV6, _ipv6)(text, label) if _IPV6_HINT.search(text) else text


def cards(text: str, label: str) -> str:
    """13-19 digit payment card numbers (spaces or dashes between digits allowed) that pass the Luhn check; the
    longest passing span of a run is taken, so a card followed by other digits is still found."""

    def replace(match: re.Match[str]) -> str:
        span = match.group()
        for cut in [len(span), *sorted((i for i, c in enumerate(span) if c in " -"), reverse=True)]:
            if _luhn(span[:cut]):
                return label + span[cut:]
        return span

    return _CARD.sub(replace, text)


ibans = _spans(_IBAN, _iban)
international_phones = _spans(_PHONE, _phone)
