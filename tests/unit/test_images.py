"""Image references in records (`data.images`): no network fetch unless the recipe allows it, credentials never sent,
one total deadline and a size bound per image, and no image trained on in a reply. A local HTTP server stands in
for the network."""

import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
from PIL import Image

from speculators_train.data.config import ImagesConfig
from speculators_train.data.conversations import SkipReport, normalize_record
from speculators_train.data.images import BadImage, fetch, load, shown


def png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (4, 3), (200, 10, 10)).save(out, format="PNG")
    return out.getvalue()


class Handler(BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[str, str | None]]] = []  # (path, Authorization header) of each request the server got

    def do_GET(self):
        Handler.seen.append((self.path, self.headers.get("Authorization")))
        if self.path == "/a.png":
            body = png()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/trickle":  # a byte every 0.2 s, for ever
            self.send_response(200)
            self.end_headers()
            for _ in range(200):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.2)
        elif self.path == "/declared-huge":
            self.send_response(200)
            self.send_header("Content-Length", str(10**12))
            self.end_headers()
        elif self.path == "/undeclared-big":
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"\0" * 300_000)
        elif self.path.startswith("/to-"):  # a redirect to what follows, e.g. /to-http://u:p@host/a.png
            self.send_response(302)
            self.send_header("Location", self.path.removeprefix("/to-"))
            self.end_headers()
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


ON = ImagesConfig(fetch=True, timeout_seconds=1.0, max_bytes=100_000)


def test_a_url_is_not_fetched_unless_the_recipe_allows_it(server):
    Handler.seen.clear()
    assert ImagesConfig().fetch is False
    with pytest.raises(BadImage, match=r"data\.images\.fetch is off"):
        load(f"{server}/a.png", ImagesConfig())
    assert Handler.seen == []
    assert load(f"{server}/a.png", ON).size == (4, 3)


def test_credentials_in_a_url_or_a_redirect_are_never_sent(server):
    Handler.seen.clear()
    host = server.removeprefix("http://")
    with pytest.raises(BadImage, match="credentials, which are never sent"):
        fetch(f"http://user:secret@{host}/a.png", ON)
    assert Handler.seen == []
    with pytest.raises(BadImage, match="credentials, which are never sent"):
        fetch(f"{server}/to-http://user:secret@{host}/a.png", ON)
    assert [auth for _, auth in Handler.seen] == [None]  # the redirect itself, and nothing after it
    assert "secret" not in shown(f"http://user:secret@{host}/a.png?token=t")
    assert fetch(f"{server}/to-/a.png", ON) == png()  # a relative redirect is followed


def test_a_server_that_trickles_bytes_is_stopped_at_the_deadline(server):
    start = time.monotonic()
    with pytest.raises(BadImage, match=r"not fetched within data\.images\.timeout_seconds=1"):
        fetch(f"{server}/trickle", ON)
    assert time.monotonic() - start < 2.5


def test_an_image_over_the_size_bound_is_refused_whether_or_not_it_says_so(server, tmp_path):
    with pytest.raises(BadImage, match=r"over data\.images\.max_bytes=100000"):
        fetch(f"{server}/declared-huge", ON)
    with pytest.raises(BadImage, match=r"over data\.images\.max_bytes=100000"):
        fetch(f"{server}/undeclared-big", ON)
    big = tmp_path / "big.png"
    big.write_bytes(b"\0" * 100_001)
    with pytest.raises(BadImage, match=r"100001 bytes, over data\.images\.max_bytes"):
        load(str(big), ON)
    with pytest.raises(BadImage, match="HTTP 404"):
        fetch(f"{server}/missing.png", ON)


def test_files_and_data_urls_are_read_without_the_network(tmp_path):
    import base64

    path = tmp_path / "a.png"
    path.write_bytes(png())
    assert load(str(path), ImagesConfig()).size == (4, 3)
    assert load(f"file://{path}", ImagesConfig()).size == (4, 3)
    assert load("data:image/png;base64," + base64.b64encode(png()).decode(), ImagesConfig()).size == (4, 3)
    with pytest.raises(BadImage, match="no such file"):
        load(str(tmp_path / "missing.png"), ImagesConfig())
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(BadImage, match="not an image"):
        load(str(tmp_path / "text.png"), ImagesConfig())


def test_an_image_in_a_reply_skips_its_record_counted():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    report = SkipReport()
    reply = {"role": "assistant", "content": [{"type": "text", "text": "here"}, image]}
    record = {"messages": [{"role": "user", "content": "draw"}, reply]}
    assert normalize_record(record, "s", "f.jsonl:1", report) is None
    assert report.counts == {"image_in_reply": 1} and report.examples["image_in_reply"] == ["f.jsonl:1 turn 1"]
    asked = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, image]},
                          {"role": "assistant", "content": "a cat"}]}  # fmt: skip
    assert normalize_record(asked, "s", "f.jsonl:2", report) is not None
