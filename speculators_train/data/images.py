"""A record's image references, read as the recipe allows (`data.images`): files beside the data and data URLs
always; http(s) URLs only with `data.images.fetch: true`, never with the credentials a URL (or a redirect) carries,
within one total deadline per image (a server that trickles bytes cannot hold the stage) and a size bound, for
files too. A reference that breaks a rule is a `BadImage`: its record is skipped and counted."""

from __future__ import annotations

import http.client
import io
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

from speculators_train.data.config import ImagesConfig
from speculators_train.loading import describe

MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)


class BadImage(ValueError):
    """An image part that cannot be read (a missing file, an unreachable URL, bytes that are not an image)."""


def shown(ref: str) -> str:
    """An image reference for a message: a data URL by its media type, a URL without its query (which may hold a
    token) or credentials, at most 60 characters."""
    if ref.startswith("data:"):
        return ref.split(",", 1)[0]
    parts = urlsplit(ref.split("?", 1)[0])
    if parts.username is not None or parts.password is not None:
        ref = parts._replace(netloc=parts.hostname or "").geturl()
    else:
        ref = ref.split("?", 1)[0]
    return repr(ref if len(ref) <= 60 else "..." + ref[-57:])


def load(ref: str, policy: ImagesConfig) -> Any:
    """The image `ref` names as an RGB picture (PIL), under `policy`."""
    from PIL import Image

    if ref.startswith(("http://", "https://")):
        data = fetch(ref, policy)
    elif ref.startswith("data:") or not _local(ref).exists():
        return _decoded(ref)  # a data URL or bare base64: its size is bounded by the record's
    else:
        path = _local(ref)
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise BadImage(describe(exc)[:120]) from None
        if size > policy.max_bytes:
            raise BadImage(f"{size} bytes, over data.images.max_bytes={policy.max_bytes}")
        data = path.read_bytes()
    try:
        with Image.open(io.BytesIO(data)) as picture:
            return picture.convert("RGB")
    except Exception as exc:  # PIL raises many types for bytes that are not an image (and for decompression bombs)
        raise BadImage(f"not an image ({describe(exc)[:80]})") from None


def _local(ref: str) -> Path:
    return Path(ref.removeprefix("file://"))


def _decoded(ref: str) -> Any:
    from transformers.image_utils import load_image

    try:
        return load_image(ref)
    except Exception as exc:  # transformers' message quotes the whole reference: a data URL is megabytes
        if isinstance(exc, ValueError) and str(exc).startswith("Incorrect image source"):
            local = not ref.startswith("data:")
            raise BadImage("no such file" if local else "not an image (nor base64 of one)") from None
        raise BadImage(describe(exc)[:120]) from None


def fetch(url: str, policy: ImagesConfig) -> bytes:
    """The bytes at an http(s) `url`, following up to `MAX_REDIRECTS` redirects, within the policy's deadline and
    size bound."""
    if not policy.fetch:
        raise BadImage("a network image, and data.images.fetch is off (set it to true to fetch images by URL)")
    deadline = time.monotonic() + policy.timeout_seconds
    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BadImage(f"redirected to {shown(url)}, not an http(s) URL")
        if parts.username is not None or parts.password is not None:
            raise BadImage("the URL carries credentials, which are never sent: serve the image without them")
        try:
            status, location, body = _get(parts, deadline, policy.max_bytes)
        except (OSError, http.client.HTTPException) as exc:
            if isinstance(exc, TimeoutError | socket.timeout) or time.monotonic() >= deadline:
                raise BadImage(f"not fetched within data.images.timeout_seconds={policy.timeout_seconds:g}") from None
            raise BadImage(f"not fetched: {describe(exc)[:100]}") from None
        if status in REDIRECTS and location:
            url = urljoin(url, location)
            continue
        if status != 200:
            raise BadImage(f"HTTP {status}")
        return body
    raise BadImage(f"more than {MAX_REDIRECTS} redirects")


def _get(parts: Any, deadline: float, max_bytes: int) -> tuple[int, str | None, bytes]:
    """(status, Location, body) of one GET; every socket operation waits at most until `deadline`."""

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline")
        return left

    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname, parts.port, timeout=remaining())
    try:
        conn.connect()
        sock = conn.sock  # kept: the connection drops its reference when the reply will close it
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", target, headers={"Accept": "image/*", "User-Agent": "speculators_train"})
        response = conn.getresponse()
        if response.status != 200:
            return response.status, response.getheader("Location"), b""
        declared = response.getheader("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise BadImage(f"{declared} bytes, over data.images.max_bytes={max_bytes}")
        body = bytearray()
        while True:
            sock.settimeout(remaining())
            chunk = response.read1(65536)
            if not chunk:
                return 200, None, bytes(body)
            body += chunk
            if len(body) > max_bytes:
                raise BadImage(f"over data.images.max_bytes={max_bytes} bytes")
    finally:
        conn.close()
