"""The built-in redaction rules, listed with their labels in the package docstring (the functions some run are in
`finders.py`).

Every rule has a `trigger`: an RE2 pattern that matches wherever the rule could match (a superset, without
lookarounds; `test_each_rule_runs_wherever_it_could_match` holds every rule to it). The redactor scans each text once
for all triggers together and runs only the rules whose trigger it found, so most chat costs one linear RE2 scan.
Every Python pattern starts with a literal, a keyword or a run that can only start where the run starts, and its
unbounded parts cannot be retried from every position of a long run: each rule costs linear time in the text's length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from speculators_train.osd.redact.finders import (
    KEY_BODY_PREFIX,
    cards,
    emails,
    encoded,
    ibans,
    international_phones,
    ip_addresses,
    private_keys,
)


@dataclass(frozen=True)
class Rule:
    """One built-in redaction: its name, what it matches (in words), the label left in its place, the RE2 `trigger`
    that finds every text it could change, and how it is applied: regexes (a named group `keep` is kept before the
    label) or a function (text, label) -> text, or (text, label, redact) -> text when `nested` (it runs the rules on
    what it decodes)."""

    name: str
    matches: str
    label: str
    trigger: str
    patterns: tuple[str, ...] = ()
    function: Callable[..., str] | None = None
    nested: bool = False


_TOKEN = "A-Za-z0-9_\\-"  # base64url, and the alphabet of prefixed API keys
_VALUE = r"""(?:"[^"\n]*"?|'[^'\n]*'?|[^\s"',;&]+)"""  # a quoted string (to its closing quote) or one word
_LABEL_SEP = r"""["']?[ \t]*(?:[:=]{1,2}>?)[ \t]*"""  # `=`, `: `, `":"`, `==`, `=>`
# A label's separator, also the keyword forms of config scanners: `"key"   "value"`, `['key']  value`.
_LOOSE_SEP = (
    r"""(?:["'\]]{0,2}[ \t]{0,256}[:=]{1,2}>?[ \t]{0,256}["']?|["'\]]{1,2}[ \t]{1,256}["']?|[ \t]{1,256}["'])"""
)
_UNLABELLED = r"(?!\[[A-Za-z_]+\])"  # a value an earlier rule replaced by its label is left as it is
# What follows a label in code and templates, not a secret: a placeholder (`your_key_here`, `<token>`, `$VAR`,
# `{{ secret }}`, `%s`, `xxxx`), a call or an index (`request.form['password']`, `getpass()`), a type (`password: str`).
_NOT_A_VALUE = (
    r"(?![\"'`]?[^\s\"'`]{0,64}?(?i:your|example|placeholder|xxxx|\*\*\*\*|changeme))"
    r"(?![\"'`]?[$<{%\[])"
    r"(?![A-Za-z_][\w.:\->]{0,64}[(\[])"
    r"(?!(?i:str|string|int|bool|bytes|text|varchar|char|any|none|null|true|false|optional|required)\b)"
)
# A labelled value that looks generated: 8+ characters with a digit among the first 256, or 32+ characters; no cap
_WITH_DIGIT = r"(?:(?=[^\s\"',;&]{0,256}?[0-9])|(?=[^\s\"',;&]{32}))[^\s\"',;&]{8,}"
# `pass` as a label where code or config writes it (`"pass":`, `DB_PASS=`, `&pass=`, `  pass: x` at a line's start),
# not in prose (`1-day pass: 2,400 yen`)
_PASS = r"(?:(?<=[_\"'&?;,{(])|(?<![^\n])[ \t]*)pass"
_SECRET_WORDS = r"(?:key|token|secret|pass(?:word)?|pwd|pw)"
_STRONG_WORDS = r"(?:token|secret|pass(?:word)?|pwd|pw)"  # `key` alone also ends `primary_key`, `hotkey`, `sort_key`
# A value after a bare `key` label looks generated only when longer: 16+ characters of a token's alphabet with a digit
# (`primary_key: user_id1`, `hotkey: ctrl+shift+1`, `cache key: user:123456` are names, not keys), or 32+ of any
_KEY_VALUE = (
    r"(?:(?=[A-Za-z0-9_\-+/=]{0,256}?[0-9])[A-Za-z0-9_\-+/=]{16,}(?![^\s\"',;&])|(?=[^\s\"',;&]{32})[^\s\"',;&]+)"
)
# Working directories, not passwords: the shell's `PWD=/home/me` and `OLDPWD=~/src`
_NOT_A_DIRECTORY = r"(?!(?:pwd|PWD)[ \t]*=[ \t]*[\"']?[/~])"  # (?i) rules run on the lowered text
# A count after a label (`pass: 3` in a test summary), not a password
_NOT_A_COUNT = r"(?![0-9]{1,3}(?![^\s\"',;&]))"
_BLOCK_SCALAR = r"[|>][+\-]?[0-9]?[ \t]*"  # YAML's `|`, `>-`, `|2`: the value is on the lines below
_PROSE_LINKS = r"(?:is|was|=|will be|would be|should be|set to|is set to|is now|changed to|reset to)"

RULES: tuple[Rule, ...] = (
    Rule(
        "private_key",
        "a private key block (PEM, OpenSSH, PGP; the header may be wrapped or missing), a PuTTY key file, a DER or "
        "OpenSSH key body without its header",
        "[PRIVATE_KEY]",
        rf"PRIVATE\s+KEY|PuTTY-User-Key-File-[0-9]|{KEY_BODY_PREFIX}",
        function=private_keys,
    ),
    Rule(
        "service_token",
        "webhook URLs (Slack, Discord, Teams) and service tokens (npm, PyPI, Docker Hub, GitLab, Stripe webhook, "
        "SendGrid, Shopify, Google OAuth and refresh tokens, Square, Databricks, DigitalOcean, Telegram and Discord "
        "bots, Mailchimp, Twilio, Artifactory)",
        "[TOKEN]",
        r"hooks\.slack\.com/|discord(?:app)?\.com/api/webhooks/|webhook\.office\.com/|npm_|pypi-AgE|dckr_pat_|"
        r"gl(?:dt|rt|cbt|ptt|ft|soat|imt|agent|oas)-|whsec_|SG\.|shp(?:at|ca|pa|ss)_|ya29\.|1//0|sq0(?:atp|csp)-|"
        r"dapi|do[por]_v1_|softlayer|[0-9]{8,10}:[A-Za-z0-9_\-]{35}|GR1348941|[MNO][A-Za-z0-9_\-]{23,25}\.[A-Za-z0-9_\-]{6}\.|"
        r"[0-9a-z]{32}-us[0-9]|(?:AC|SK)[a-z0-9]{32}|AP[0-9A-F][A-Za-z0-9]{8}",
        (
            r"hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9_/\-]{8,}",
            r"discord(?:app)?\.com/api/webhooks/[0-9]{5,30}/[A-Za-z0-9_\-]{20,}",
            r"webhook\.office\.com/webhookb2/[^\s\"'<>]{16,}",
            r"npm_(?<![A-Za-z0-9_]....)[A-Za-z0-9]{36}",
            r"pypi-AgE(?<![A-Za-z0-9_]........)[A-Za-z0-9_\-]{50,}",
            r"dckr_pat_(?<![A-Za-z0-9_].........)[A-Za-z0-9_\-]{20,}",
            r"(?<![A-Za-z0-9_])gl(?:dt|rt|cbt|ptt|ft|soat|imt|agent|oas)-[A-Za-z0-9_\-]{20,}",
            r"whsec_(?<![A-Za-z0-9_]......)[A-Za-z0-9]{24,}",
            r"SG\.(?<![A-Za-z0-9_]...)[A-Za-z0-9_\-]{22}\.[A-Za-z0-9_\-]{43}",
            r"shp(?:at|ca|pa|ss)_[a-fA-F0-9]{32}",
            r"ya29\.(?<![A-Za-z0-9_].....)[A-Za-z0-9_\-]{20,}",
            r"1//0(?<![A-Za-z0-9_:/]....)[A-Za-z0-9_\-]{20,}",
            r"sq0(?:atp|csp)-[A-Za-z0-9_\\\-]{22,}",
            r"dapi(?<![A-Za-z0-9_]....)[a-f0-9]{32}",
            r"do[por]_v1_[a-f0-9]{64}",
            r"(?<![0-9])[0-9]{8,10}:[A-Za-z0-9_\-]{35}(?![A-Za-z0-9_\-])",
            r"GR1348941[A-Za-z0-9_\-]{20,}",
            r"api.softlayer.com/soap/v3(?:.1)?/[a-z0-9]{64}",
            r"(?<![A-Za-z0-9_\-])[MNO][A-Za-z0-9_\-]{23,25}\.[A-Za-z0-9_\-]{6}\.[A-Za-z0-9_\-]{27}",
            r"(?<![0-9a-z])[0-9a-z]{32}-us[0-9]{1,2}(?![0-9])",
            r"(?<![A-Za-z0-9])(?:AC|SK)[a-z0-9]{32}(?![A-Za-z0-9])",
            # Artifactory `AP` keys: a digit and a lower-case letter, so capitalised words and acronyms stay
            r"(?<![A-Za-z0-9])AP[0-9A-F](?=[A-Za-z0-9]{0,64}?[0-9])(?=[A-Za-z0-9]{0,64}?[a-z])[A-Za-z0-9]{8,}",
        ),
    ),
    Rule(
        "jwt",
        "a JSON Web Token: two or three base64url segments, the first starting eyJ",
        "[JWT]",
        r"eyJ[A-Za-z0-9_\-=]*\.[A-Za-z0-9_\-=]",
        (rf"eyJ(?<![{_TOKEN}]...)[{_TOKEN}=]*\.[{_TOKEN}=]{{2,}}(?:\.[{_TOKEN}.+/=]*)?",),
    ),
    Rule(
        "github_token",
        "GitHub tokens: ghp_ gho_ ghu_ ghs_ ghr_ and github_pat_",
        "[GITHUB_TOKEN]",
        r"gh[pousr]_|github_pat_",
        (
            r"gh[pousr]_(?<![A-Za-z0-9_]....)[A-Za-z0-9_]{20,}",
            r"github_pat_(?<![A-Za-z0-9_]...........)[A-Za-z0-9_]{20,}",
        ),
    ),
    Rule(
        "api_key",
        "prefixed API keys: sk- sk_ pk_ rk_ hf_ xox?- xapp- (Slack) glpat- AIza AKC",
        "[API_KEY]",
        r"sk[-_]|pk_|rk_|hf_|xox[a-z]-|xapp-|glpat-|AIza|AKC",
        (
            rf"sk[-_](?<![A-Za-z0-9_]...)[{_TOKEN}]{{16,}}",
            rf"pk_(?<![A-Za-z0-9_]...)[{_TOKEN}]{{16,}}",
            rf"rk_(?<![A-Za-z0-9_]...)[{_TOKEN}]{{16,}}",
            rf"hf_(?<![A-Za-z0-9_]...)[{_TOKEN}]{{16,}}",
            rf"xox[abposre]-(?<![A-Za-z0-9_].....)(?:[0-9]+-[A-Za-z0-9\-]+|[{_TOKEN}]{{16,}})",
            rf"xapp-(?<![A-Za-z0-9_].....)[{_TOKEN}]{{16,}}",
            rf"glpat-(?<![A-Za-z0-9_]......)[{_TOKEN}]{{16,}}",
            rf"AIza(?<![A-Za-z0-9_]....)[{_TOKEN}]{{30,}}",
            r"AKC(?<![A-Za-z0-9_]...)[A-Za-z0-9]{10,}",
        ),
    ),
    Rule(
        "aws_key_id",
        "AWS access key ids: AKIA ASIA ABIA ACCA A3T? and 16 upper-case letters or digits",
        "[AWS_KEY_ID]",
        r"(?:AKIA|ASIA|ABIA|ACCA|A3T[A-Z0-9])[A-Z0-9]{16}",
        (r"(?:AKIA|ASIA|ABIA|ACCA|A3T[A-Z0-9])(?<![A-Za-z0-9]....)[A-Z0-9]{16}(?![A-Za-z0-9])",),
    ),
    Rule(
        "signed_url",
        "the signature and credential parameters of a signed URL (S3 X-Amz-Signature, GCS X-Goog-Signature, Azure "
        "SAS sig=, token= / access_token= / code=); the name kept",
        "[SIGNATURE]",
        r"(?i)[?&;](?:x-amz-signature|x-amz-credential|x-amz-security-token|x-goog-signature|x-goog-credential|"
        r"sig|signature|token|access_token|id_token|refresh_token|api_key|apikey|client_secret|code)=",
        (
            r"(?i)(?P<keep>[?&;](?:x-amz-signature|x-amz-credential|x-amz-security-token|x-goog-signature|"
            r"x-goog-credential|sig|signature|token|access_token|id_token|refresh_token|api_key|apikey|client_secret|"
            rf"code)=){_UNLABELLED}{_NOT_A_VALUE}[^&\s#\"'<>]+",
        ),
    ),
    Rule(
        "url_credentials",
        "user:password in a URL (scheme://user:password@host); scheme and host kept",
        "[CREDENTIALS]",
        r"://[^\s:/?#@\"'<>]*:[^\s/?#@\"'<>]+@",
        (r"""(?P<keep>://)[^\s:/?#@"'<>]{0,256}:[^\s/?#@"'<>]+(?=@)""",),
    ),
    Rule(
        "auth_header",
        "the credentials after Authorization: / Proxy-Authorization: (any scheme); name and scheme kept",
        "[AUTH]",
        r"(?i)authorization",
        (
            rf"""(?i)(?P<keep>authorization{_LABEL_SEP}["']?(?:[A-Za-z][A-Za-z0-9\-]{{0,19}}[ \t]+)?)"""
            rf"""{_UNLABELLED}{_NOT_A_VALUE}[^\s"',;]+""",
        ),
    ),
    Rule(
        "bearer",
        "Bearer <token of 16+ characters>",
        "[BEARER]",
        r"(?i)bearer\s",
        (r"(?i)bearer(?<![^\W_]......)\s+[A-Za-z0-9._~+/=\-]{16,}",),
    ),
    Rule(
        "cli_password",
        "the value of a command-line password, token or key option (--password X, -storepass X, sshpass -p X, "
        "mysql -pX, curl -u user:X); the option kept",
        "[PASSWORD]",
        r"(?i)-[a-z0-9_\-]*(?:password|passwd|pass|passphrase|pwd|token|secret|api[-_]?key|access[-_]?key|"
        r"secret[-_]?key)[= \t]|sshpass|mysql|mariadb|curl",
        (
            r"(?i)(?P<keep>(?<![\w\-])--?[a-z0-9_\-]{0,32}?(?:password|passwd|pass|passphrase|pwd|token|secret|"
            rf"api[-_]?key|access[-_]?key|secret[-_]?key)(?:=|[ \t]+)[\"']?){_UNLABELLED}{_NOT_A_VALUE}"
            r"(?!-)[^\s\"']+",
            rf"(?P<keep>\bsshpass[ \t]+-p[ \t]*[\"']?){_UNLABELLED}{_NOT_A_VALUE}[^\s\"']+",
            r"(?P<keep>\b(?:mysql|mysqldump|mysqladmin|mysqlimport|mariadb)\b[^\n]{0,256}?[ \t]-p[\"']?)"
            rf"{_UNLABELLED}{_NOT_A_VALUE}(?=[^\s\-])[^\s\"']+",
            r"(?P<keep>\bcurl\b[^\n]{0,256}?[ \t](?:-u|--user)[ \t=]*[\"']?[^\s:\"']{1,256}:)"
            rf"{_UNLABELLED}{_NOT_A_VALUE}[^\s\"']+",
        ),
    ),
    Rule(
        "config_password",
        "the password of a .netrc entry (machine h login u password X) and of a .pgpass line "
        "(host:port:db:user:X); the rest kept",
        "[PASSWORD]",
        r"(?i)password\s|[^:\s]+:(?:[0-9]+|\*):[^:\s]+:[^:\s]+:\S",
        (
            r"(?i)(?P<keep>\b(?:machine[ \t\r\n]+\S{1,256}|default)"
            r"(?:[ \t\r\n]+(?:login|account|port)[ \t\r\n]+\S{1,256}){0,3}[ \t\r\n]+password[ \t\r\n]+)"
            rf"{_UNLABELLED}\S+",
            # at a line's start, or quoted in a sentence (after a space, a quote or a backtick)
            r"(?m)(?P<keep>(?:^|(?<=[ \t`'\"]))[^:\s#`'\"]{1,256}:(?:[0-9]{1,5}|\*):[^:\s]{1,256}:[^:\s]{1,256}:)"
            rf"{_UNLABELLED}[^\s`'\"]+",
        ),
    ),
    Rule(
        "password",
        "the value after password / passwd / passphrase / passcode / pwd / pass labels; label kept",
        "[PASSWORD]",
        rf"(?i)(?:password|passwd|passphrase|passcode|pwd|pass){_LABEL_SEP}",
        (
            rf"(?i)(?P<keep>(?:password|passwd|passphrase|passcode|{_NOT_A_DIRECTORY}pwd|{_PASS}){_LABEL_SEP})"
            rf"{_UNLABELLED}{_NOT_A_VALUE}{_NOT_A_COUNT}(?!{_BLOCK_SCALAR}(?:\r?\n|$)){_VALUE}",
            # the value on the next line: `password:` alone on its line, or a YAML block scalar (`password: |`),
            # not a nested mapping's key (`password:\n  secretKeyRef:`) or a list
            rf"(?i)(?P<keep>(?:password|passwd|passphrase|passcode)[\"']?[ \t]*:[ \t]*(?:{_BLOCK_SCALAR})?"
            rf"\r?\n[ \t]*){_UNLABELLED}{_NOT_A_VALUE}(?![^\s:]{{0,256}}:(?:\s|$))(?!-\s)[^\s]+",
        ),
    ),
    Rule(
        "password_prose",
        "a password told in prose (my password is X, the passcode for the router was 'X'): a quoted value, or a "
        "word holding a digit or a symbol; the words kept",
        "[PASSWORD]",
        rf"(?i)(?:password|passwd|passphrase|passcode|pwd)\s.{{0,120}}?{_PROSE_LINKS}\s",
        (
            r"(?i)(?P<keep>(?<![a-z])(?:password|passwd|passphrase|passcode|pwd)"
            r"(?:[ \t]+(?:for|of|on|to)(?:[ \t]+[^\s]{1,32}){1,3})?"
            rf"[ \t]+{_PROSE_LINKS}[ \t]*:?[ \t]+){_UNLABELLED}{_NOT_A_VALUE}"
            r"""(?:"[^"\n]{1,256}"|'[^'\n]{1,256}'|`[^`\n]{1,256}`|(?=[^\s]{0,64}?[0-9!@#$%^&*+=~?])[^\s"'`]{3,})""",
        ),
    ),
    Rule(
        "aws_secret",
        "the base64 value (16+ characters) after an AWS secret-key label, and a quoted 40-character secret within "
        "a line after aws ... key; label kept",
        "[AWS_SECRET]",
        rf"(?i)secret[_\-.]?(?:access[_\-.]?)?key{_LABEL_SEP}|aws.*(?:key|pwd|pw|pass|token).*[\"'][A-Za-z0-9/+]{{40}}[\"']",
        (
            rf"""(?i)(?P<keep>secret[_\-.]?(?:access[_\-.]?)?key{_LABEL_SEP}["']?){_UNLABELLED}[A-Za-z0-9/+=]{{16,}}""",
            r"""(?i)(?P<keep>aws[^\n]{0,64}?(?:key|pwd|pw|password|pass|token)[^\n]{0,64}?["'])"""
            r"""[A-Za-z0-9/+]{40}(?=["'])""",
        ),
    ),
    Rule(
        "cookie",
        "the value of a Cookie: / Set-Cookie: header or key, to the end of the line; the name kept",
        "[COOKIE]",
        r"(?i)cookie[\"']?[ \t]*[:=]",
        (rf"""(?i)(?P<keep>cookie["']?[ \t]*[:=][ \t]*["']?){_UNLABELLED}[^\r\n"']+""",),
    ),
    Rule(
        "env_secret",
        "the value of a .env / shell assignment whose upper-case name ends in SECRET, TOKEN, KEY, PASS, PASSWORD, "
        "PWD, CREDENTIALS or AUTH (SECRET_KEY=..., export GITHUB_TOKEN=...); the name kept",
        "[SECRET]",
        r"(?:SECRET|TOKEN|KEY|PASS|PASSWORD|PASSWD|PWD|CREDENTIALS|AUTH)[ \t]*=",
        (
            r"(?m)(?P<keep>^[ \t]*(?:export[ \t]+)?(?:[A-Z][A-Z0-9_]{0,64}_)?"
            rf"(?:SECRET|TOKEN|KEY|PASS|PASSWORD|PASSWD|{_NOT_A_DIRECTORY}PWD|CREDENTIALS|AUTH)[ \t]*=[ \t]*[\"']?)"
            rf"{_UNLABELLED}{_NOT_A_VALUE}[^\s\"']+",
        ),
    ),
    Rule(
        "credential",
        "the value after api_key / apikey / access_token / refresh_token / id_token / auth_token / client_secret / "
        "app_secret / secret_token / session_token / account_key / private_key_id / client-key-data / X-API-Key "
        'labels, and a registry\'s "auth" / "identitytoken" (docker config.json); label kept',
        "[SECRET]",
        r"(?i)(?:api[_\-]?key|(?:access|refresh|id|auth|secret|session|sas)[_\-]?token|(?:client|app)[_\-]?secret|"
        r"account[_\-]?key|private[_\-]?key[_\-]?id|client[_\-]key[_\-]data)[\"']?[ \t]*[:=]|"
        r"\"(?:auth|identitytoken|registrytoken)\"",
        (
            r"(?i)(?P<keep>(?:api[_\-]?key|(?:access|refresh|id|auth|secret|session|sas)[_\-]?token|"
            r"(?:client|app)[_\-]?secret|account[_\-]?key|private[_\-]?key[_\-]?id|client[_\-]key[_\-]data)"
            rf"{_LABEL_SEP}){_UNLABELLED}{_NOT_A_VALUE}{_VALUE}",
            rf"""(?P<keep>"(?:auth|identitytoken|registrytoken)"[ \t]*:[ \t]*"){_UNLABELLED}[^"\s]{{8,}}""",
        ),
    ),
    Rule(
        "labelled_secret",
        "a value of 8+ characters holding a digit (or of 32+) after any label ending in key / token / secret / pass / "
        "pwd / pw, also in config scanners' keyword forms ('cl_apikey'   \"value\") and after vendor labels "
        "(ibm / iam / cloudant / softlayer / cos ... key, any 8+ characters); label kept",
        "[SECRET]",
        rf"(?i){_SECRET_WORDS}(?:[\"'\]]|[ \t]*[:=]|[ \t]+[\"'])|(?:ibm|iam|cloudant|softlayer|cos|hmac|sl|cl)[\w\-]*"
        rf"{_SECRET_WORDS}",
        (
            rf"(?i)(?P<keep>{_STRONG_WORDS}{_LOOSE_SEP})(?!\[){_NOT_A_VALUE}{_WITH_DIGIT}",
            rf"(?i)(?P<keep>key{_LOOSE_SEP})(?!\[){_NOT_A_VALUE}{_KEY_VALUE}",
            r"(?i)(?P<keep>(?<![a-z])(?:ibm|iam|cloudant|softlayer|cos|hmac|sl|cl|clou)"
            r"(?:[_\-]{0,2}(?:cloud|iam|cos|hmac|api|secret|access))*[_\-]{0,2}"
            rf"{_SECRET_WORDS}[\"'\]]{{0,2}}\s{{0,256}}(?:[:=]{{1,2}}>?)?\s{{0,256}}[\"']?)(?!\[){_NOT_A_VALUE}"
            r"[^\s\"',;&]{8,}",
        ),
    ),
    Rule(
        "encoded",
        "a base64 or base64url run of 24+ characters whose decoded text holds anything the rules remove (an encoded "
        "private key, a kubeconfig's client-key-data, a wrapped token)",
        "[ENCODED_SECRET]",
        r"[A-Za-z0-9+/_\-]{24}",
        function=encoded,
        nested=True,
    ),
    Rule(
        "email",
        "an e-mail address: local@domain.tld",
        "[EMAIL]",
        r"[A-Za-z0-9._%+\-]@[A-Za-z0-9.\-]+\.[A-Za-z]{2}",
        function=emails,
    ),
    Rule(
        "card",
        "payment card numbers: 13-19 digits (spaces, dashes) passing Luhn",
        "[CARD]",
        r"[0-9](?:[ \-]?[0-9]){12}",
        function=cards,
    ),
    Rule(
        "iban",
        "IBANs passing the mod-97 check",
        "[IBAN]",
        r"[A-Z]{2}[0-9]{2}(?: ?[A-Z0-9]){11}",
        function=ibans,
    ),
    Rule(
        "national_id",
        "US social security numbers (123-45-6789) and UK National Insurance numbers (AB 12 34 56 C)",
        "[NATIONAL_ID]",
        r"[0-9]{3}-[0-9]{2}-[0-9]{4}|[A-Z]{2} ?[0-9]{2} ?[0-9]{2} ?[0-9]{2} ?[A-D]",
        (
            r"(?<![0-9\-])(?!000|666|9)[0-9]{3}-(?!00)[0-9]{2}-(?!0000)[0-9]{4}(?![0-9\-])",
            r"(?<![A-Za-z0-9])[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z] ?[0-9]{2} ?[0-9]{2} ?[0-9]{2} ?[A-D](?![A-Za-z0-9])",
        ),
    ),
    Rule(
        "phone",
        "phone numbers: international (+ and 8-15 digits) and North American ((555) 123-4567, 555-123-4567)",
        "[PHONE]",
        r"\+[1-9][0-9 ().\-]{6,22}[0-9]|[2-9][0-9]{2}\)?[ .\-][0-9]{3}[ .\-][0-9]{4}",
        (r"(?<![0-9\-.])\(?[2-9][0-9]{2}\)?[ .\-][0-9]{3}[ .\-][0-9]{4}(?![0-9\-]|\.[0-9])",),
        function=international_phones,
    ),
    Rule(
        "ip_address",
        "IPv4 addresses, and IPv6 addresses of three or more groups",
        "[IP]",
        r"[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}|:[0-9A-Fa-f]{0,4}:[0-9A-Fa-f]{1,4}",
        function=ip_addresses,
    ),
)
