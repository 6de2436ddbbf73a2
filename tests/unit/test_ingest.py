"""Hostile input for OSD log ingestion: secrets in every place a log line can put them, lines nested or sized to
break a parser, and every way log rotation moves or cuts a file (rename, copytruncate, truncation, inode reuse). Each
case is one entry of the hostile-input catalogue; the linear-time bounds and kill -9 at every event of a pass run in
children of their own (tests/e2e/test_ingest_faults.py)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pytest

from speculators_train.errors import UserError
from speculators_train.osd import redact
from speculators_train.osd.ingest import LogIngestor
from speculators_train.osd.redact import RULES, Redactor
from tests.conftest import SHAREGPT, make_recipe
from tests.faults import clean_error


def line(i: int, text: str = "Sort a list in Python?") -> str:
    """A log line with a unique id (its number) and a body long enough to make files span several KB."""
    return json.dumps({"id": i, "messages": [{"role": "user", "content": f"{text} #{i}"}], "response": "x" * 150})


def write(path: Path, lines: list[str], mode: str = "w") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, mode) as fh:
        fh.writelines(item + "\n" for item in lines)


def ingestor(logs: Path, root: Path, **options) -> LogIngestor:
    return LogIngestor(logs, root, Redactor([], True), options.pop("commit_every", 256), **options)


def stored(root: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(root.rglob("*")) if p.is_file())


def ids_once(ing: LogIngestor) -> list[int]:
    """The record ids stored, each asserted to be stored once, with unique origins."""
    entries = list(ing.entries())
    origins = Counter(e["origin"] for e in entries)
    assert max(origins.values(), default=1) == 1, [o for o, n in origins.items() if n > 1]
    ids = Counter(int(e["id"].split(":")[1]) for e in entries if "id" in e)
    assert max(ids.values(), default=1) == 1, [i for i, n in ids.items() if n > 1]
    return sorted(ids)


# ---------------------------------------------------------------------------------------------------------------------
# Redaction: each secret, in a message and in a quarantined (invalid JSON) line, never reaches the disk.

JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
PEM = "MIIEowIBAAKCAQEA3Tz2mr7SZiAMfQyuvBjM2Oq8Xyf9kRb6bqN0zq1XkN3l0Jg7"
SECRETS = [  # (id, text holding it, the secret, the label left)
    ("email", "mail alice@example.com now", "alice@example.com", "[EMAIL]"),
    (
        "email_end_of_sentence",
        "write to bob.smith+osd@mail.example.co.uk.",
        "bob.smith+osd@mail.example.co.uk",
        "[EMAIL]",
    ),
    ("email_behind_another_at", "x@carol@example.org", "carol@example.org", "[EMAIL]"),
    ("aws_access_key_id", "key AKIAIOSFODNN7EXAMPLE set", "AKIAIOSFODNN7EXAMPLE", "[AWS_KEY_ID]"),
    ("aws_temporary_key_id", "ASIAY34FZKBOKMUTVV7A", "ASIAY34FZKBOKMUTVV7A", "[AWS_KEY_ID]"),
    ("aws_secret_ini", f"aws_secret_access_key = {AWS_SECRET}", AWS_SECRET, "[AWS_SECRET]"),
    ("aws_secret_env", f"export AWS_SECRET_ACCESS_KEY={AWS_SECRET}", AWS_SECRET, "[AWS_SECRET]"),
    ("aws_secret_sts_json", f'{{"SecretAccessKey": "{AWS_SECRET}"}}', AWS_SECRET, "[AWS_SECRET]"),
    ("github_fine_grained_pat", "github_pat_11ABCDEFG0" + "a1B2c3D4e5" * 8, "a1B2c3D4e5" * 8, "[GITHUB_TOKEN]"),
    ("github_ghp", "token ghp_" + "Ab3" * 12, "Ab3" * 12, "[GITHUB_TOKEN]"),
    ("github_gho", "gho_" + "Zx9" * 12, "Zx9" * 12, "[GITHUB_TOKEN]"),
    ("github_ghs", "ghs_" + "Qw7" * 12, "Qw7" * 12, "[GITHUB_TOKEN]"),
    ("jwt", f"cookie={JWT};", JWT, "[JWT]"),
    ("password_query", "login?user=bob&password=hunter2&x=1", "hunter2", "[PASSWORD]"),
    ("passwd_colon", "passwd: s3cr3t-Pa55", "s3cr3t-Pa55", "[PASSWORD]"),
    ("pwd_equals", "mysql -u root pwd=Tr0ub4dor", "Tr0ub4dor", "[PASSWORD]"),
    ("password_json", '{"user": "bob", "password": "correct horse battery"}', "correct horse", "[PASSWORD]"),
    ("password_env", "DB_PASSWORD='p@ss w0rd!'", "w0rd!", "[PASSWORD]"),
    ("authorization_basic", "Authorization: Basic dXNlcjpodW50ZXIy", "dXNlcjpodW50ZXIy", "[AUTH]"),
    ("authorization_json", '{"Authorization": "Basic dXNlcjpodW50ZXIy"}', "dXNlcjpodW50ZXIy", "[AUTH]"),
    ("proxy_authorization", "Proxy-Authorization: Digest 9f86d081884c7d659a2feaa0c55ad015", "9f86d0818", "[AUTH]"),
    ("authorization_bearer", "authorization: Bearer abcdefghijklmnop123", "abcdefghijklmnop123", "[AUTH]"),
    ("bearer_alone", "use bearer abcdefghijklmnopqrstuv0", "abcdefghijklmnopqrstuv0", "[BEARER]"),
    ("openai_key", "sk-proj-" + "A1b2C3d4" * 4, "A1b2C3d4" * 4, "[API_KEY]"),
    ("slack_token", "xoxb-123456789012-abcdefghijklmnop", "abcdefghijklmnop", "[API_KEY]"),
    ("huggingface_token", "hf_" + "aBcD" * 8, "aBcD" * 8, "[API_KEY]"),
    ("rsa_private_key", f"-----BEGIN RSA PRIVATE KEY-----\n{PEM}\n-----END RSA PRIVATE KEY-----", PEM, "[PRIVATE_KEY]"),
    (
        "openssh_private_key",
        f"-----BEGIN OPENSSH PRIVATE KEY-----\n{PEM}\n-----END OPENSSH PRIVATE",
        PEM,
        "[PRIVATE_KEY]",
    ),
    (
        "service_account_key",
        f'{{"private_key": "-----BEGIN PRIVATE KEY-----\\n{PEM}\\n-----END PRIVATE KEY-----\\n"}}',
        PEM,
        "[PRIVATE_KEY]",
    ),
    (
        "service_account_key_id",
        '{"private_key_id": "3f9a1c0b7e2d4a6b8c0d1e2f3a4b5c6d7e8f9a0b"}',
        "3f9a1c0b7e2d",
        "[SECRET]",
    ),
    ("postgres_url", "DATABASE_URL=postgres://admin:Zq8v!x@db.internal:5432/app", "Zq8v!x", "[CREDENTIALS]"),
    ("redis_url_user_only_password", "redis://:s3cretRedis@cache:6379/0", "s3cretRedis", "[CREDENTIALS]"),
    ("api_key_label", "api_key=Zk4mQ9pL2xV7 in the config", "Zk4mQ9pL2xV7", "[SECRET]"),
    ("access_token_json", '{"access_token": "ya.Qm9vNzVhYmNkZWYxMjM0"}', "Qm9vNzVhYmNkZWYxMjM0", "[SECRET]"),
    ("client_secret_yaml", "client_secret: 'Wn3rT8yU1iO5pA9s'", "Wn3rT8yU1iO5pA9s", "[SECRET]"),
    ("x_api_key_header", "X-API-Key: 7c4d9e2f1a8b3c6d", "7c4d9e2f1a8b3c6d", "[SECRET]"),
    ("cookie_header", "Cookie: sessionid=Hx81jK2mQp; csrftoken=Tz93Lq", "Hx81jK2mQp", "[COOKIE]"),
    ("set_cookie_header", "Set-Cookie: auth=Rk29Vb71Qa; Path=/; HttpOnly", "Rk29Vb71Qa", "[COOKIE]"),
    (
        "slack_webhook",
        "https://hooks.slack.com/services/T0ABCDEF1/B0ABCDEF2/Vb7Qm2Kx9Lp4Zt6Rw1Yn3Hs8",
        "Vb7Qm2Kx9Lp4",
        "[TOKEN]",
    ),
    (
        "discord_webhook",
        "https://discord.com/api/webhooks/123456789012345678/Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z",
        "Ab3dEf6hIj9kLm2nOp5q",
        "[TOKEN]",
    ),
    ("npm_token", "//registry.npmjs.org/:_authToken=npm_" + "Q7w" * 12, "Q7w" * 12, "[TOKEN]"),
    ("pypi_token", "password = pypi-AgEIcHlwaS5vcmc" + "Xy9_" * 14, "Xy9_" * 14, "[TOKEN]"),
    ("docker_hub_pat", "dckr_pat_" + "Ab1-" * 7, "Ab1-" * 7, "[TOKEN]"),
    ("stripe_webhook_secret", "whsec_" + "Mn4Pq7" * 5, "Mn4Pq7" * 5, "[TOKEN]"),
    ("sendgrid_key", "SG." + "a1B2c3D4e5F6g7H8i9J0kL" + "." + "m" * 43, "a1B2c3D4e5F6g7H8i9J0kL", "[TOKEN]"),
    ("telegram_bot", "bot 1234567890:AA" + "Hk3" * 11, "Hk3" * 11, "[TOKEN]"),
    ("visa_card", "card 4111 1111 1111 1111, exp 12/29", "4111 1111 1111 1111", "[CARD]"),
    ("amex_card_dashes", "amex 3782-822463-10005", "3782-822463-10005", "[CARD]"),
    ("card_then_digits", "pay 5555555555554444 1234", "5555555555554444", "[CARD]"),
    ("iban", "IBAN DE89 3704 0044 0532 0130 00 please", "3704 0044 0532", "[IBAN]"),
    ("us_ssn", "SSN 078-05-1120 on file", "078-05-1120", "[NATIONAL_ID]"),
    ("uk_nino", "NI number JG 10 37 20 A", "JG 10 37 20 A", "[NATIONAL_ID]"),
    ("phone_international", "call +44 20 7946 0958 today", "7946 0958", "[PHONE]"),
    ("phone_north_american", "cell (415) 555-2671", "555-2671", "[PHONE]"),
    ("ipv4", "from 203.0.113.42.", "203.0.113.42", "[IP]"),
    ("ipv6", "peer 2001:db8:85a3::8a2e:370:7334 up", "2001:db8:85a3::8a2e:370:7334", "[IP]"),
    ("fullwidth_at", "mail zqxeve\uff20example.com", "zqxeve", "[EMAIL]"),
    ("zero_width_in_key", "sk-proj-\u200b" + "A1b2C3d4" * 4, "A1b2C3d4A1b2C3d4", "[API_KEY]"),
    ("fullwidth_key_prefix", "\uff53\uff4b-" + "Q9w8E7r6T5y4U3i2", "Q9w8E7r6T5y4U3i2", "[API_KEY]"),
    # the forms of the third hostile-input round: prose, command lines, config files, signed URLs, long values, keys
    # without their header, base64 payloads, encoded and look-alike labels, prefixes outside the first list
    ("prose_password", "btw my password is Hunter2!! so use that", "Hunter2!!", "[PASSWORD]"),
    ("prose_quoted_passcode", "the passcode for the wifi router was 'blue canary'", "blue canary", "[PASSWORD]"),
    ("cli_password_option", "tool --password Zq8vX1 --verbose", "Zq8vX1", "[PASSWORD]"),
    ("cli_keytool_storepass", "keytool -list -storepass Ch4ngeIt", "Ch4ngeIt", "[PASSWORD]"),
    ("cli_mysql_attached", "mysql -h db -u root -pS3cretDb app", "S3cretDb", "[PASSWORD]"),
    ("cli_sshpass", "sshpass -p 'Tr0ub4dor' ssh admin@host", "Tr0ub4dor", "[PASSWORD]"),
    ("cli_curl_user", "curl -u deploy:Xk29fLq https://ci.local", "Xk29fLq", "[PASSWORD]"),
    ("netrc", "machine api.example.net\n  login bob\n  password Wq7zNx", "Wq7zNx", "[PASSWORD]"),
    ("pgpass", "the pgpass file holds\ndb.internal:5432:app:bob:Pg7pass", "Pg7pass", "[PASSWORD]"),
    ("short_pass_label", '{"user": "bob", "pass": "Kz81qa"}', "Kz81qa", "[PASSWORD]"),
    ("docker_auth", '{"auths": {"ghcr.io": {"auth": "Ym9iOmh1bnRlcjI="}}}', "Ym9iOmh1bnRlcjI", "[SECRET]"),
    ("dotenv_secret", "my .env:\nexport STRIPE_SECRET=wXnqLbRzPt", "wXnqLbRzPt", "[SECRET]"),  # no digit: only as .env
    ("s3_presigned", "get.tar?X-Amz-Expires=3600&X-Amz-Signature=9f2c41aa07&x=1", "9f2c41aa07", "[SIGNATURE]"),
    ("azure_sas", "f?sv=2022-11-02&sp=r&sig=Lk3%2Bq9Vz%3D", "Lk3%2Bq9Vz", "[SIGNATURE]"),
    ("long_labelled_token", "cloudant_key = " + "Ab1" * 120 + "TAILSECRET", "TAILSECRET", "[SECRET]"),
    (
        "pem_wrapped_header",
        f"-----BEGIN RSA PRIVATE\nKEY-----\n{PEM}\n-----END RSA PRIVATE KEY-----",
        PEM,
        "[PRIVATE_KEY]",
    ),
    ("pem_without_begin", f"here it is:\n{PEM}\n{PEM}\n-----END PRIVATE KEY-----", PEM, "[PRIVATE_KEY]"),
    ("der_body_without_header", f"the key is {PEM}", PEM, "[PRIVATE_KEY]"),
    (
        "putty_key",
        f"PuTTY-User-Key-File-3: ssh-rsa\nEncryption: none\nPrivate-Lines: 1\n{PEM}\nPrivate-MAC: 0a1b",
        PEM,
        "[PRIVATE_KEY]",
    ),
    (
        "base64_wrapped_key",
        "client-key-data " + base64.b64encode(f"-----BEGIN PRIVATE KEY-----\n{PEM}\n".encode()).decode(),
        base64.b64encode(b"-----BEGIN PRIVATE KEY-----").decode()[:24],
        "[ENCODED_SECRET]",
    ),
    (
        "base64_wrapped_token",
        "blob " + base64.b64encode(b"token: Xq81LmZa0pQ7").decode(),
        base64.b64encode(b"token: Xq81LmZa0pQ7").decode(),
        "[ENCODED_SECRET]",
    ),
    ("percent_encoded_label", "q=api%5Fkey%3DZk4mQ9pL2xV7", "Zk4mQ9pL2xV7", "[SECRET]"),
    ("html_escaped_label", "{&quot;password&quot;: &quot;Hn4rT8y&quot;}", "Hn4rT8y", "[PASSWORD]"),
    ("cyrillic_lookalike_label", "p\u0430ssw\u043erd: Rt5yU8iO", "Rt5yU8iO", "[PASSWORD]"),
    ("slack_app_token", "xapp-1-A02ABCDEF-1234567890-abcdef0123456789", "1234567890-abcdef", "[API_KEY]"),
    ("google_refresh_token", "1//0gX7kLmNoPqRsTuVwXyZ0123456789", "gX7kLmNoPqRsTuVwXyZ", "[TOKEN]"),
    ("pgpass_in_backticks", "my pgpass has `db.example.com:5432:mydb:alice:S3cr!t9` in it", "S3cr!t9", "[PASSWORD]"),
    ("pgpass_quoted", 'add "db:5432:app:bob:Pa55word" to ~/.pgpass', "Pa55word", "[PASSWORD]"),
    ("password_on_the_next_line", "password:\n  hunter2xyz\nuser: bob", "hunter2xyz", "[PASSWORD]"),
    ("yaml_literal_password", "db:\n  password: |\n    s3cr3t-v4lue\n  user: x", "s3cr3t-v4lue", "[PASSWORD]"),
    ("yaml_folded_password", "password: >-\n  another-Secret1", "another-Secret1", "[PASSWORD]"),
]


@pytest.mark.parametrize("where", ["message", "quarantined_line"])
@pytest.mark.parametrize(("text", "secret", "label"), [c[1:] for c in SECRETS], ids=[c[0] for c in SECRETS])
def test_each_secret_is_redacted_before_it_is_stored(tmp_path, where, text, secret, label):
    logs = tmp_path / "logs"
    record = {"id": 1, "messages": [{"role": "user", "content": f"before {text} after"}], "response": "ok"}
    raw = json.dumps(record)
    write(logs / "a.jsonl", [raw if where == "message" else raw[:-3]])  # cut short: invalid JSON, quarantined
    ing = ingestor(logs, tmp_path / "state")
    stats = ing.run()
    assert (stats.records, stats.quarantined) == ((1, 0) if where == "message" else (0, 1))
    on_disk = stored(tmp_path / "state")
    assert secret not in on_disk and json.dumps(secret)[1:-1] not in on_disk
    (entry,) = ing.entries()
    assert label in (entry["messages"][0]["content"] if where == "message" else entry["raw"])


ESCAPED = [  # (id, the line as logged, the secret, the label left) - JSON escapes must not hide a secret
    (
        "unicode_escaped_at_in_broken_line",
        r'{"prompt": "mail zqxeve\u0040example.com", "completion": ',
        "zqxeve",
        "[EMAIL]",
    ),
    (
        "escaped_dot_and_slash_in_broken_line",
        r'{"prompt": "zqxeve\u0040example\u002ecom \/ x", "oops',
        "zqxeve",
        "[EMAIL]",
    ),
    ("escaped_quotes_hide_a_password", r'{"prompt": "cfg {\"password\": \"hunter2\"}", "oops', "hunter2", "[PASSWORD]"),
    (
        "double_escaped_at_in_a_message",
        r'{"prompt": "zqxeve\\u0040example.com", "completion": "ok"}',
        "zqxeve",
        "[EMAIL]",
    ),
    (
        "escaped_email_as_record_id",
        r'{"id": "zqxeve\u0040example.com", "prompt": "hi", "completion": "ok"}',
        "zqxeve",
        "[EMAIL]",
    ),
]


@pytest.mark.parametrize(("raw", "secret", "label"), [c[1:] for c in ESCAPED], ids=[c[0] for c in ESCAPED])
def test_json_escapes_do_not_hide_a_secret(tmp_path, raw, secret, label):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "a.jsonl").write_text(raw + "\n")
    ingestor(logs, tmp_path / "state").run()
    on_disk = stored(tmp_path / "state")
    assert secret not in on_disk and label in on_disk


@pytest.mark.parametrize("key", ["id", "request_id"])
def test_a_record_id_holding_an_email_is_redacted(tmp_path, key):
    logs = tmp_path / "logs"
    write(logs / "a.jsonl", [json.dumps({key: "alice@example.com-42", "prompt": "hi", "completion": "ok"})])
    ing = ingestor(logs, tmp_path / "state")
    ing.run()
    assert [c.id for c in ing.conversations()] == ["logs:[EMAIL]-42"]
    assert "alice" not in stored(tmp_path / "state")


@pytest.mark.parametrize(
    "text",
    [
        "task_scheduler_configuration = load()",  # `sk_` inside an identifier
        "a basic understanding of recursion",  # `basic` is not a credential without Authorization
        "the bearer of bad news",  # too short to be a token
        "sha256 e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        "ssh user@localhost",  # no domain suffix: not an address
        "AKIA is how AWS key ids start",
        "std::vector<int> v; auto s = x[1::2]; at 12:30:45",  # `::` in code and a time are not IPv6 addresses
        "In 2023-01-15 we sold 1,234,567 units, up 12.5% on 3.14",  # dates, counts, versions
        "the order 4111111111111112 and 1234567890123",  # digit runs failing Luhn are not cards
        "the api key is set in settings",  # a label without a value
        "* 1-day pass: 2,400 yen",  # `pass` in prose is no label
        "password = request.form['password']",  # code reading a password, not one
        "def login(user: str, password: str) -> bool:",  # a type
        "api_key = 'YOUR_API_KEY_HERE'",  # a placeholder
        "curl -u $USER:$PASS https://x",  # variables
        "GITHUB_TOKEN = credentials('github-token')",  # a call
        "secure login and password protection, data encryption",  # prose
        "proxy_pass http://127.0.0.1:8000; ping 0.0.0.0",  # loopback and unspecified addresses name no one
        "Sample Output: 1 3 5 7 9 11 13 15 17 19",  # a digit run passing Luhn by chance, without an issuer digit
        "\u041f\u0430\u0440\u043e\u043b\u044c \u0441\u043e\u0440 \u0440\u043e\u0441",  # Russian in look-alike letters
        "git clone git@github.com:org/repo.git && scp me@host.example.com:notes.txt .",  # scp addresses, no mailbox
        "PWD=/home/alice OLDPWD=~/src",  # the shell's working directories
        "pass: 3\nfail: 0",  # a test summary's counts
        '{"primary_key": "user_id1", "hotkey": "ctrl+shift+1", "cache key": "user:123456"}',  # names ending in key
        "Windows version 10.0.0.1, pip install pkg==1.2.3.4, v2.0.1.7",  # four-part version numbers
        "password:\n  secretKeyRef:\n    name: db",  # a Kubernetes reference to a secret, not one
    ],
    ids=[
        "identifier_with_sk_",
        "basic_in_prose",
        "bearer_in_prose",
        "hex_digest",
        "user_at_localhost",
        "akia_word",
        "code_and_times",
        "dates_and_numbers",
        "non_luhn_digits",
        "label_without_value",
        "pass_in_prose",
        "code_reading_a_password",
        "type_annotation",
        "placeholder_value",
        "shell_variables",
        "a_call",
        "password_in_prose",
        "loopback_addresses",
        "luhn_by_chance",
        "russian_lookalikes",
        "scp_addresses",
        "working_directories",
        "counts_after_pass",
        "names_ending_in_key",
        "version_numbers",
        "secret_reference",
    ],
)
def test_ordinary_text_is_left_alone(text):
    assert Redactor([], True)(text) == text


def test_each_rule_runs_wherever_it_could_match():
    """A rule runs only on texts its RE2 trigger finds something in: a trigger narrower than the rule would let a
    secret through unseen. Each rule, run directly on every case of this file and on their decoded forms, changes a
    text only where its trigger matches."""
    redactor = Redactor([], True)
    texts = [case[1] for case in SECRETS] + [case[0] for case in ESCAPED]
    texts += [f"before {text} after" for text in texts]
    texts += [redact._decode(text) for text in texts]
    checked = Counter()
    for text in texts:
        for index, rule in enumerate(RULES):
            lowered = text.lower() if text.isascii() else None
            if any(step(text, lowered) != text for step in redactor.steps[index]):
                checked[rule.name] += 1
                assert redactor.triggers.each[index].search(text.encode("utf-8", "surrogatepass")), (rule.name, text)
    assert set(checked) == {rule.name for rule in RULES}  # every rule had a case


def test_a_secret_inside_nested_encodings_is_found_to_a_bounded_depth():
    """base64 inside base64 and a percent-encoded JSON-escaped label are decoded level by level; past
    `DECODE_LEVELS` a payload is left as it is (a bound on the work, not a way around it: ingestion then stores an
    encoding no reader decodes by accident)."""
    inner = "token: Xq81LmZa0pQ7"
    twice = base64.b64encode(base64.b64encode(inner.encode())).decode()
    out = Redactor([], True)(f"blob {twice} end")
    assert twice not in out and "[ENCODED_SECRET]" in out
    assert "Xq81" not in Redactor([], True)("cfg=%7B\\u0022password\\u0022: \\u0022Xq81LmZa0pQ7\\u0022%7D")
    deep = inner
    for _ in range(redact.DECODE_LEVELS + 2):
        deep = base64.b64encode(deep.encode()).decode()
    assert Redactor([], True)(f"blob {deep} end") == f"blob {deep} end"


def test_a_users_pattern_runs_on_text_holding_a_lone_surrogate():
    """JSON may escape a lone surrogate (`\\ud800`): the decoded text cannot be encoded strictly, which RE2 needs."""
    text = json.loads('"x \\ud800 secret-12 y"')
    assert Redactor(["secret-[0-9]+"], True)(text) == "x \ud800 [REDACTED] y"


def test_the_documented_list_names_every_builtin_rule():
    """docs/guide/stages.md points at the package docstring: it must list every rule, with its label, in the order
    they run."""
    doc = redact.__doc__
    positions = [doc.index(f"    {rule.name} ") for rule in RULES]
    assert positions == sorted(positions)
    for rule in RULES:
        assert rule.label in doc.split(f"    {rule.name} ", 1)[1].split("\n", 1)[0], rule.name


def test_a_token_in_a_log_file_name_reaches_neither_origins_nor_state(tmp_path):
    token = "ghp_" + "Ab3" * 12
    logs = tmp_path / "logs"
    write(logs / f"app-{token}.jsonl", [line(0), "{not json"])
    ing = ingestor(logs, tmp_path / "state")
    assert ing.run().records == 1
    assert token not in stored(tmp_path / "state")
    assert {e["origin"] for e in ing.entries()} == {"app-[GITHUB_TOKEN].jsonl:1", "app-[GITHUB_TOKEN].jsonl:2"}
    write(logs / f"app-{token}.jsonl", [line(1)], mode="a")  # the same file is still followed under its name
    assert ing.run().records == 1 and token not in stored(tmp_path / "state")


@pytest.mark.parametrize("pattern", ["(a)\\1", "(?<=x)y", "("], ids=["backreference", "lookbehind", "unbalanced"])
def test_a_pattern_re2_cannot_run_is_one_line(tmp_path, capsys, pattern):
    with pytest.raises(UserError, match=r"osd\.redact\[1\]: .* is not an RE2 regex"):
        Redactor(["ok", pattern], True)
    logs = tmp_path / "logs"
    write(logs / "a.jsonl", [line(0)])
    sources = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}]
    recipe = make_recipe(tmp_path, sources, osd={"redact": [pattern]})
    clean_error(["osd", recipe, "--logs", logs, "--ingest-only"], capsys, "osd.redact[0]", "not an RE2 regex")


HOOKS = """
def raising_hook(text):
    raise ValueError("cannot handle " + text)


def integer_hook(text):
    return len(text)
"""


@pytest.mark.parametrize(
    ("hook", "reason"),
    [("raising_hook", "osd.redact_hook raised ValueError"), ("integer_hook", "returned int, not text")],
)
def test_a_failing_redact_hook_quarantines_the_line_without_its_text(tmp_path, monkeypatch, hook, reason):
    (tmp_path / "user_hooks.py").write_text(HOOKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    logs = tmp_path / "logs"
    write(logs / "a.jsonl", [line(0, "private words"), "{broken private words"])
    ing = LogIngestor(logs, tmp_path / "state", Redactor([], True, f"user_hooks:{hook}"), 256)
    stats = ing.run()
    assert (stats.records, stats.quarantined) == (0, 2)
    assert stats.reasons == {"redact_hook_failed": 2}
    assert "private words" not in stored(tmp_path / "state")
    assert all(reason in e["quarantined"] and e["raw"] == "" for e in ing.entries())


# ---------------------------------------------------------------------------------------------------------------------
# Lines built to break a parser or memory: quarantined with a reason, never a crash.

HOSTILE_LINES = [  # (id, the line's bytes, None for a record or the quarantine reason's start)
    ("array_nested_100k_deep", b"[" * 100_000 + b"]" * 100_000, "invalid_json: nested too deeply"),
    (
        "content_nested_100k_deep",
        b'{"messages": [{"role": "user", "content": ' + b"[" * 100_000 + b"]" * 100_000 + b'}], "response": "y"}',
        "invalid_json: nested too deeply",
    ),
    ("integer_of_5000_digits", b'{"prompt": "x", "completion": "y", "n": ' + b"7" * 5000 + b"}", "invalid_json"),
    ("lone_surrogate", b'{"prompt": "\\ud800 x", "completion": "y"}', "lone_surrogate"),
    ("invalid_utf8", b'{"prompt": "\xff\xfe", "completion": "y"}', "invalid_json"),
    ("nul_bytes", b'\x00\x00{"prompt": "x", "completion": "y"}', "invalid_json"),
    ("top_level_string", b'"just a string"', "not_an_object"),
    ("crlf_line_end", b'{"prompt": "x", "completion": "y"}\r', None),
    ("byte_order_mark", b'\xef\xbb\xbf{"prompt": "x", "completion": "y"}', None),
    ("nan_in_an_unused_field", b'{"prompt": "x", "completion": "y", "score": NaN}', None),
]


@pytest.mark.parametrize(("raw", "reason"), [c[1:] for c in HOSTILE_LINES], ids=[c[0] for c in HOSTILE_LINES])
def test_a_hostile_line_is_quarantined_with_its_reason_and_the_next_line_is_read(tmp_path, raw, reason):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "a.jsonl").write_bytes(raw + b"\n" + line(1).encode() + b"\n")
    ing = ingestor(logs, tmp_path / "state")
    stats = ing.run()
    entries = list(ing.entries())
    assert stats.records == (2 if reason is None else 1) and "id" in entries[-1]
    if reason is not None:
        assert entries[0]["quarantined"].startswith(reason), entries[0]["quarantined"]
        assert entries[0]["origin"] == "a.jsonl:1"


def test_a_line_over_the_length_limit_is_quarantined_without_its_text(tmp_path):
    logs = tmp_path / "logs"
    write(logs / "a.jsonl", [line(0), json.dumps({"prompt": "alice@example.com " * 400, "completion": "y"}), line(1)])
    ing = ingestor(logs, tmp_path / "state", max_line_bytes=4000)
    stats = ing.run()
    assert (stats.records, stats.reasons) == (2, {"line_too_long": 1})
    too_long = next(e for e in ing.entries() if "quarantined" in e)
    assert too_long["origin"] == "a.jsonl:2" and too_long["raw"] == ""
    assert "alice" not in stored(tmp_path / "state")
    assert ids_once(ing) == [0, 1]


def test_big_lines_are_committed_by_size_not_only_by_count(tmp_path):
    """A batch of 256 lines of 20 MB would hold 5 GB in memory: commits also come every `commit_bytes`."""
    logs = tmp_path / "logs"
    write(logs / "a.jsonl", [line(i, "y" * 3000) for i in range(10)])
    ing = ingestor(logs, tmp_path / "state", commit_bytes=6000)
    ing.run()
    assert len(ing.state["segments"]) == 5 and ids_once(ing) == list(range(10))


def test_a_run_directory_inside_the_logs_is_not_ingested(tmp_path):
    logs = tmp_path / "logs"
    write(logs / "a.jsonl", [line(0)])
    ingestor(logs, logs / "run" / "ingest").run()
    ing = ingestor(logs, logs / "run" / "ingest")
    stats = ing.run()
    assert (stats.files, stats.records, stats.quarantined) == (1, 0, 0)
    assert (ing.state["records"], ing.state["quarantined"]) == (1, 0)


@pytest.mark.parametrize(
    "content",
    [
        '["not", "a", "state"]',
        '{"files": [], "segments": [], "records": 0, "quarantined": 0}',
        '{"version": 9, "files": {}, "segments": [], "records": 0, "quarantined": 0}',
        '{"version": 2, "files": {}, "segments": [], "records": 0, "quarantined": 0, "retired": []}',
    ],
    ids=["a_list", "files_not_an_object", "unknown_version", "version_2_without_names"],
)
def test_a_damaged_state_file_is_refused_with_its_name(tmp_path, content, capsys):
    logs = tmp_path / "logs"
    write(logs / "a.jsonl", [line(0)])
    recipe = make_recipe(tmp_path, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}])
    state = tmp_path / "run" / "osd" / "ingest" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text(content)
    with pytest.raises(UserError, match=r"state\.json: ingestion state (is damaged|of an unknown version)"):
        ingestor(logs, state.parent)
    clean_error(["osd", recipe, "--logs", logs, "--ingest-only"], capsys, "ingestion state")


# ---------------------------------------------------------------------------------------------------------------------
# Rotation and truncation: every line stored exactly once, with a unique origin.


def test_truncated_and_regrown_past_the_old_offset_with_the_same_start_loses_nothing(tmp_path):
    """The new content repeats the first 6 KB (more than the head fingerprint covers), then differs: only the bytes
    before the committed offset tell the rewrite apart."""
    logs = tmp_path / "logs"
    first = [line(i) for i in range(40)]
    write(logs / "a.jsonl", first)
    ingestor(logs, tmp_path / "state").run()
    write(logs / "a.jsonl", first[:30] + [line(i) for i in range(100, 120)])  # same inode, truncated and rewritten
    ing = ingestor(logs, tmp_path / "state")
    stats = ing.run()
    assert "rotated or rewritten" in stats.notes[0]
    assert stats.records == 50 and sorted(Counter(ids_once_all(ing)).values()) == [1] * 30 + [2] * 30
    assert {e["origin"] for e in ing.entries()} >= {"a.jsonl:40", "a.jsonl#2:1", "a.jsonl#2:50"}


def ids_once_all(ing: LogIngestor) -> list[int]:
    """Record ids, repeats allowed (a rewritten file may legitimately log a line again), origins unique."""
    entries = list(ing.entries())
    assert len({e["origin"] for e in entries}) == len(entries)
    return [int(e["id"].split(":")[1]) for e in entries if "id" in e]


def test_truncated_and_regrown_with_a_new_start_is_read_from_the_start(tmp_path):
    logs = tmp_path / "logs"
    write(logs / "a.jsonl", [line(i) for i in range(10)])
    ingestor(logs, tmp_path / "state").run()
    write(logs / "a.jsonl", [line(i) for i in range(100, 130)])
    ing = ingestor(logs, tmp_path / "state")
    assert ing.run().records == 30 and ids_once(ing) == list(range(10)) + list(range(100, 130))


@pytest.mark.parametrize("rotated", ["a.jsonl.1", "a.jsonl-20250101", "old/a.jsonl.1", "a-2025-01-01.jsonl"])
def test_rename_rotation_keeps_the_lines_appended_before_the_rename(tmp_path, rotated):
    """Lines appended after the last pass live only in the renamed file; a new `a.jsonl` starts after it. Renamed to
    another `*.jsonl` name, the old file is not read again from its start."""
    logs = tmp_path / "logs"
    write(logs / "a.jsonl", [line(i) for i in range(10)])
    ingestor(logs, tmp_path / "state").run()
    write(logs / "a.jsonl", [line(i) for i in range(10, 13)], "a")
    (logs / rotated).parent.mkdir(exist_ok=True)
    os.rename(logs / "a.jsonl", logs / rotated)
    write(logs / "a.jsonl", [line(i) for i in range(13, 16)])
    ing = ingestor(logs, tmp_path / "state")
    assert ing.run().records == 6 and ids_once(ing) == list(range(16))
    origins = {e["origin"] for e in list(ing.entries())[10:]}
    assert origins == {f"{rotated}:11", f"{rotated}:12", f"{rotated}:13", "a.jsonl#2:1", "a.jsonl#2:2", "a.jsonl#2:3"}


def test_two_rename_rotations_give_every_origin_once(tmp_path):
    logs = tmp_path / "logs"
    n = 0
    for _ in range(3):
        write(logs / "a.jsonl", [line(i) for i in range(n, n + 4)], "a")
        n += 4
        ingestor(logs, tmp_path / "state").run()
        write(logs / "a.jsonl", [line(i) for i in range(n, n + 2)], "a")
        n += 2
        if (logs / "a.jsonl.1").exists():
            os.rename(logs / "a.jsonl.1", logs / "a.jsonl.2")
        os.rename(logs / "a.jsonl", logs / "a.jsonl.1")
    ing = ingestor(logs, tmp_path / "state")
    ing.run()
    assert ids_once(ing) == list(range(n))
    assert "a.jsonl.1#2:5" in {e["origin"] for e in ing.entries()}


def copytruncate(logs: Path, name: str = "a.jsonl", copy: str = "a.jsonl.1") -> None:
    shutil.copyfile(logs / name, logs / copy)
    os.truncate(logs / name, 0)


@pytest.mark.parametrize("lines", [10, 80], ids=["small_file", "file_over_the_fingerprint_windows"])
def test_copytruncate_reads_the_lines_that_only_the_copy_holds(tmp_path, lines):
    logs = tmp_path / "logs"
    write(logs / "a.jsonl", [line(i) for i in range(lines)])
    ingestor(logs, tmp_path / "state").run()
    write(logs / "a.jsonl", [line(i) for i in range(lines, lines + 3)], "a")
    copytruncate(logs)
    write(logs / "a.jsonl", [line(i) for i in range(lines + 3, lines + 5)], "a")  # the writer goes on
    ing = ingestor(logs, tmp_path / "state")
    assert ing.run().records == 5 and ids_once(ing) == list(range(lines + 5))
    origins = {e["origin"] for e in ing.entries()}
    assert {f"a.jsonl.1:{lines + 1}", f"a.jsonl.1:{lines + 3}", "a.jsonl#2:2"} <= origins


def test_copytruncate_with_the_file_regrown_past_the_old_offset(tmp_path):
    logs = tmp_path / "logs"
    write(logs / "a.jsonl", [line(i) for i in range(5)])
    ingestor(logs, tmp_path / "state").run()
    write(logs / "a.jsonl", [line(5)], "a")
    copytruncate(logs)
    write(logs / "a.jsonl", [line(i) for i in range(6, 30)], "a")
    ing = ingestor(logs, tmp_path / "state")
    ing.run()
    assert ids_once(ing) == list(range(30))


def test_a_pass_between_the_copy_and_the_truncation_does_not_read_the_copy_again(tmp_path):
    logs = tmp_path / "logs"
    write(logs / "a.jsonl", [line(i) for i in range(20)])
    ingestor(logs, tmp_path / "state").run()
    write(logs / "a.jsonl", [line(i) for i in range(20, 23)], "a")
    shutil.copyfile(logs / "a.jsonl", logs / "a.jsonl.1")
    write(logs / "a.jsonl", [line(23)], "a")
    ingestor(logs, tmp_path / "state").run()  # the copy is there, the original not truncated yet
    os.truncate(logs / "a.jsonl", 0)
    write(logs / "a.jsonl", [line(24)], "a")
    ing = ingestor(logs, tmp_path / "state")
    ing.run()
    assert ids_once(ing) == list(range(25))


def test_a_copy_seen_half_written_is_finished_without_repeats(tmp_path):
    logs = tmp_path / "logs"
    write(logs / "a.jsonl", [line(i) for i in range(30)])
    ingestor(logs, tmp_path / "state").run()
    write(logs / "a.jsonl", [line(i) for i in range(30, 34)], "a")
    data = (logs / "a.jsonl").read_bytes()
    (logs / "a.jsonl.1").write_bytes(data[: len(data) // 2 + 7])  # the copy is in progress, cut mid-line
    ingestor(logs, tmp_path / "state").run()
    (logs / "a.jsonl.1").write_bytes(data)
    os.truncate(logs / "a.jsonl", 0)
    ing = ingestor(logs, tmp_path / "state")
    ing.run()
    assert ids_once(ing) == list(range(34))


def test_copytruncate_twice_with_renames_gives_every_origin_once(tmp_path):
    logs = tmp_path / "logs"
    n = 0
    for _ in range(3):
        write(logs / "a.jsonl", [line(i) for i in range(n, n + 4)], "a")
        n += 4
        ingestor(logs, tmp_path / "state").run()
        write(logs / "a.jsonl", [line(i) for i in range(n, n + 2)], "a")
        n += 2
        if (logs / "a.jsonl.1").exists():
            os.rename(logs / "a.jsonl.1", logs / "a.jsonl.2")
        copytruncate(logs)
    ing = ingestor(logs, tmp_path / "state")
    ing.run()
    assert ids_once(ing) == list(range(n))


def test_unrelated_files_with_equal_lines_are_both_read(tmp_path):
    """Content is matched across files only for a rotated name of the same log: equal lines elsewhere are traffic."""
    logs = tmp_path / "logs"
    write(logs / "a.jsonl", [line(1)])
    write(logs / "b.jsonl", [line(1)])
    ing = ingestor(logs, tmp_path / "state")
    assert ing.run().records == 2


def test_a_deleted_and_recreated_file_with_the_same_start_is_read_whole(tmp_path):
    """Delete, then a new file of the same name (which may get the same inode) starting with the same lines."""
    logs = tmp_path / "logs"
    write(logs / "a.jsonl", [line(i) for i in range(40)])
    ingestor(logs, tmp_path / "state").run()
    (logs / "a.jsonl").unlink()
    write(logs / "a.jsonl", [line(i) for i in range(30)] + [line(i) for i in range(100, 115)])
    ing = ingestor(logs, tmp_path / "state")
    assert ing.run().records == 45


@pytest.mark.parametrize("link", [os.link, os.symlink], ids=["hard_link", "symbolic_link"])
def test_a_file_under_two_names_is_read_once(tmp_path, link):
    logs = tmp_path / "logs"
    write(logs / "a.jsonl", [line(i) for i in range(5)])
    link(logs / "a.jsonl", logs / "current.jsonl")
    ing = ingestor(logs, tmp_path / "state")
    assert ing.run().records == 5 and ids_once(ing) == list(range(5))


def test_compressed_rotated_files_are_not_read(tmp_path):
    logs = tmp_path / "logs"
    write(logs / "a.jsonl", [line(0)])
    (logs / "a.jsonl.2.gz").write_bytes(b"\x1f\x8b\x08\x00 compressed")
    (logs / "a.jsonl-20250101.zst").write_bytes(b"(\xb5/\xfd compressed")
    stats = ingestor(logs, tmp_path / "state").run()
    assert (stats.files, stats.records, stats.quarantined) == (1, 1, 0)


def old_state(logs: Path, root: Path, name: str, lines: list[str]) -> None:
    """A state.json and segment as the name-keyed version wrote them, after reading `lines` of `name`."""
    data = "".join(item + "\n" for item in lines).encode()
    (root / "segments").mkdir(parents=True)
    entries = [
        {"origin": f"{name}:{n + 1}", "id": f"logs:{json.loads(x)['id']}", "messages": []} for n, x in enumerate(lines)
    ]
    (root / "segments" / "000000.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    head = hashlib.sha256(data[:4096]).hexdigest()
    files = {name: {"offset": len(data), "lines": len(lines), "head_sha256": head}}
    state = {"files": files, "segments": ["000000.jsonl"], "records": len(lines), "quarantined": 0}
    (root / "state.json").write_text(json.dumps(state))


@pytest.mark.parametrize("rotated_since", [False, True], ids=["same_file", "renamed_since"])
def test_a_state_of_the_name_keyed_format_is_migrated(tmp_path, rotated_since):
    logs, root = tmp_path / "logs", tmp_path / "state"
    write(logs / "a.jsonl", [line(i) for i in range(8)])
    old_state(logs, root, "a.jsonl", [line(i) for i in range(8)])
    write(logs / "a.jsonl", [line(8), line(9)], "a")
    if rotated_since:
        os.rename(logs / "a.jsonl", logs / "a.jsonl.1")
        write(logs / "a.jsonl", [line(10)])
    ing = ingestor(logs, root)
    stats = ing.run()
    assert any("migrated from the name-keyed format" in note for note in stats.notes)
    assert ids_once(ing) == list(range(11 if rotated_since else 10))
    assert ing.state["version"] == 2 and json.loads((root / "state.json").read_text())["version"] == 2
    assert ("a.jsonl.1:9" if rotated_since else "a.jsonl:9") in {e["origin"] for e in ing.entries()}


def test_a_pass_over_many_files_commits_per_batch_and_finds_relatives_by_name(tmp_path, monkeypatch):
    """Linear in the number of files (10,000 files once took 611 s): one batch runs across files, so 300 one-line
    files commit the state (which names every file) twice, not 300 times; and a file's relatives for copy detection
    are looked up by name, not compared with every file."""
    from speculators_train.osd import ingest as ingest_module
    from speculators_train.osd.logfiles import Relatives, log_files

    logs = tmp_path / "logs"
    for i in range(300):
        write(logs / f"app-{i:05d}.jsonl", [line(i)])
    write(logs / "svc.jsonl", [line(300)])
    write(logs / "svc.jsonl.1", [line(301)])
    writes = []
    real = ingest_module.atomic_write_json
    monkeypatch.setattr(ingest_module, "atomic_write_json", lambda *a, **k: (writes.append(1), real(*a, **k)))
    ing = ingestor(logs, tmp_path / "state", commit_every=256)
    assert ing.run().records == 302 and len(writes) == 2
    assert sorted(ids_once(ing)) == list(range(302))
    files = log_files(logs, tmp_path / "state", Redactor([], True), [])
    relatives = Relatives(files, ing.state)
    assert [f.name for f in relatives.of("app-00007.jsonl")] == ["app-00007.jsonl"]
    assert [f.name for f in relatives.of("svc.jsonl.1")] == ["svc.jsonl", "svc.jsonl.1"]


def test_a_file_name_holding_terminal_escapes_is_printed_and_stored_escaped(tmp_path):
    logs = tmp_path / "logs"
    write(logs / "a\x1b[2J\x1b]0;owned\x07.jsonl", [line(1)])
    ing = ingestor(logs, tmp_path / "state")
    ing.run()
    (entry,) = ing.entries()
    assert entry["origin"] == "a\\x1b[2J\\x1b]0;owned\\x07.jsonl:1"
    assert "\x1b" not in (tmp_path / "state" / "state.json").read_text()
