"""An engine that answers wrongly: llama-server replying with something other than the JSON it documents, or not
at all. Each is one line naming the server, the request and its log, never a traceback or a silent wrong result."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from speculators_train.engines.llamacpp.server import Server
from speculators_train.errors import UserError


@pytest.fixture
def answering(tmp_path) -> Iterator[callable]:
    """A local HTTP server answering every POST with the given bytes (or never, with None); returns a `Server`
    client pointed at it."""
    servers = []

    def start(body: bytes | None) -> Server:
        release = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                if body is None:
                    release.wait(30)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append((httpd, release))
        client = Server(tmp_path / "target.gguf", [], tmp_path / "server.log")
        client.url = f"http://127.0.0.1:{httpd.server_address[1]}"
        return client

    yield start
    for httpd, release in servers:
        release.set()
        httpd.shutdown()


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"<html>502 Bad Gateway</html>", "the answer is not JSON"),
        (b"\xff\xfe\x00garbage", "the answer is not JSON"),
        (b"[1, 2, 3]", "the answer is not a JSON object"),
        (b'{"tokens": "12 13"}', "'tokens' is not a list of token ids"),
        (b'{"tokens": [1, 2.5]}', "'tokens' is not a list of token ids"),
        (b'{"tokens": [1, true]}', "'tokens' is not a list of token ids"),
    ],
    ids=["html", "binary", "a-list", "tokens-a-string", "tokens-a-float", "tokens-a-bool"],
)
def test_a_reply_that_is_not_what_llama_server_documents_is_one_line(answering, body, needle):
    client = answering(body)
    with pytest.raises(UserError, match="llama-server") as info:
        client.generate([1, 2, 3], 4, 0.0, 1.0, 0)
    assert needle in str(info.value) and client.url in str(info.value)


def test_a_request_never_answered_names_the_server_the_request_and_the_limit(answering, tmp_path):
    client = answering(None)
    with pytest.raises(UserError) as info:
        client._post("/completion", {"prompt": [1, 2, 3], "n_predict": 4}, timeout=1)
    message = str(info.value)
    assert f"{client.url}/completion" in message and "target.gguf" in message
    assert "no answer within 1 s" in message and "3 prompt tokens and 4 new" in message
    assert str(tmp_path / "server.log") in message


def test_timings_of_the_wrong_type_are_refused(answering, monkeypatch):
    client = answering(json.dumps({"tokens": [5], "timings": {"predicted_ms": "fast"}}).encode())
    monkeypatch.setattr(Server, "metrics", lambda self: {})
    with pytest.raises(UserError, match="'timings'"):
        client.complete([1, 2], 4)


def test_a_server_that_answers_correctly_still_works(answering):
    assert answering(b'{"tokens": [7, 8], "timings": {}}').generate([1], 2, 0.0, 1.0, 0) == [7, 8]
