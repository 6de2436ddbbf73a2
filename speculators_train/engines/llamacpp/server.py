"""A llama-server process on a free local port, and the HTTP client that decodes with it.

Kept apart from the build (`build.py`) because this is what runs on every verify and regeneration: a child process
ended with its group, and replies from it checked as untrusted input (each failure is one line naming the server,
the request and its log). A server here decodes one request at a time, greedily, with prompt caching off, and
reports per request what llama.cpp counted: generated tokens, decode time, drafted and accepted tokens, verify steps
and acceptance per draft position (from /metrics, before and after the request).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speculators_train import children
from speculators_train.engines.llamacpp.build import ensure_built
from speculators_train.errors import UserError

# llama-server's --spec-type for a plain causal LM draft; without a type the server loads a draft and never drafts.
# Each export format names its own type (`ExportFormat.llamacpp_spec_type`).
PLAIN_LM = "draft-simple"


def draft_args(draft: Path, spec_type: str | None, k: int, p_min: float = 0.0) -> list[str]:
    """llama-server's arguments for the draft GGUF `draft` of `--spec-type` `spec_type` (None: a type the server
    detects from the file) at K draft tokens per step (p_min 0: every step drafts all K)."""
    spec_type = [] if spec_type is None else ["--spec-type", spec_type]
    return [
        "-md", str(draft), *spec_type,
        "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0", "--spec-draft-p-min", f"{p_min:g}",
    ]  # fmt: skip


def serve_command(verifier: str, draft: Path, spec_type: str | None, k: int) -> str:
    """The `llama-server` command line a user runs for the target GGUF `verifier` with this draft."""
    return f"llama-server {shlex.join(['-m', verifier, *draft_args(draft, spec_type, k)])}"


@dataclass
class Completion:
    tokens: list[int]
    seconds: float  # llama.cpp's own decode time (prompt processing excluded)
    prompt_seconds: float
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # verify steps that carried a draft
    accepted_per_position: list[int] = field(default_factory=list)  # steps that accepted at least i + 1 drafts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_METRIC = re.compile(r'^llamacpp:(\w+)(?:\{position="(\d+)"\})?\s+([-+0-9.eE]+)$')


def parse_metrics(text: str) -> dict[str, Any]:
    """Prometheus text from llama-server's /metrics: plain counters by name, and the per-position counter as a
    list indexed by position."""
    out: dict[str, Any] = {}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if not m:
            continue
        name, position, value = m.group(1), m.group(2), float(m.group(3))
        if position is None:
            out[name] = value
        else:
            per = out.setdefault(name, [])
            per.extend([0.0] * (int(position) + 1 - len(per)))
            per[int(position)] = value
    return out


REQUEST_SECONDS = 600.0  # one completion of a verify suite or a regeneration batch, on a slow CPU


def _size(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    return f"{len(prompt)} prompt tokens and {body.get('n_predict')} new" if isinstance(prompt, list) else "one prompt"


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class Server:
    """A llama-server on a free local port, for one model and speculative setting; a context manager."""

    def __init__(
        self, model: Path, extra: list[str], logfile: Path, threads: int | None = None, ctx: int = 4096, slots: int = 1
    ):
        """`slots`: requests decoded at once (continuous batching); `ctx` is shared among them."""
        self.model, self.extra, self.logfile = model, extra, logfile
        self.threads = threads or len(os.sched_getaffinity(0))
        self.ctx, self.slots = ctx, slots
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def command(self, port: int) -> list[str]:
        return [
            str(ensure_built() / "llama-server"),
            "-m", str(self.model), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(self.threads), "-c", str(self.ctx), "-np", str(self.slots), "--metrics", "--no-webui",
            # No CPU extra buffer types (AMX, repacked layouts): on a VM that advertises AMX, the native build died
            # of SIGILL on the Q4_1 target in them, and every output here is compared within these same flags.
            "--no-repack",
            *self.extra,
        ]  # fmt: skip

    def __enter__(self) -> Server:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.logfile.parent.mkdir(parents=True, exist_ok=True)
        with open(self.logfile, "w") as out:  # the child keeps its own handle for its whole life
            self.proc = subprocess.Popen(
                self.command(port), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_healthy(300)
        except BaseException:  # not up, Ctrl-C or SIGTERM while it starts: `with` will not call __exit__
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_healthy(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = "\n".join(self.logfile.read_text(errors="replace").splitlines()[-12:])
                raise UserError(f"llama-server exited ({self.proc.returncode}) for {self.model}:\n{tail}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise UserError(f"llama-server did not come up in {seconds:.0f} s (log: {self.logfile})")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            children.end_group(self.proc)

    def _post(self, path: str, body: dict[str, Any], timeout: float = REQUEST_SECONDS) -> dict[str, Any]:
        """POST JSON and return the JSON object the server answers. Every way a reply can fail (an HTTP error, no
        answer within `timeout`, a closed connection, a body that is not a JSON object) is one line naming the
        server, the request and its log."""
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        where = f"llama-server {self.url}{path} ({self.model.name}, log {self.logfile})"
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as exc:
            raise UserError(f"{where}: HTTP {exc.code}: {exc.read()[:500]!r}") from None
        except TimeoutError:
            raise UserError(f"{where}: no answer within {timeout:.0f} s to a request of {_size(body)}") from None
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            raise UserError(f"{where}: the request failed: {getattr(exc, 'reason', exc)}") from None
        try:
            reply = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise UserError(f"{where}: the answer is not JSON: {raw[:200]!r}") from None
        if not isinstance(reply, dict):
            raise UserError(f"{where}: the answer is not a JSON object: {raw[:200]!r}")
        return reply

    def metrics(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return parse_metrics(r.read().decode(errors="replace"))

    def _tokens(self, reply: dict[str, Any]) -> list[int]:
        tokens = reply.get("tokens") or []
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise UserError(f"llama-server {self.url} ({self.model.name}): 'tokens' is not a list of token ids")
        return tokens

    def generate(self, ids: list[int], max_new_tokens: int, temperature: float, top_p: float, seed: int) -> list[int]:
        """The reply's token ids (end-of-generation token excluded) to prompt ids; safe to call from several threads,
        which the server decodes together in its slots."""
        reply = self._post(
            "/completion",
            {
                "prompt": ids,
                "n_predict": max_new_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "top_k": 0,
                "seed": seed,
                "cache_prompt": False,
                "return_tokens": True,
                "stream": False,
            },
        )
        return self._tokens(reply)

    def cpu_seconds(self) -> float:
        """CPU time the server process has used so far (user + system), from /proc."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def complete(self, ids: list[int], max_new_tokens: int, seed: int = 0) -> Completion:
        """Greedy decoding of token ids (the prompt already rendered by the chat template), stopping at the
        model's end-of-generation tokens or `max_new_tokens`."""
        before = self.metrics()
        reply = self._post(
            "/completion",
            {
                "prompt": ids,
                "n_predict": max_new_tokens,
                "temperature": 0.0,
                "seed": seed,
                "cache_prompt": False,
                "return_tokens": True,
                "stream": False,
            },
        )
        after = self.metrics()
        timings = reply.get("timings", {})
        read = ("predicted_ms", "prompt_ms", "draft_n", "draft_n_accepted")
        if not isinstance(timings, dict) or not all(_number(timings.get(k, 0)) for k in read):
            raise UserError(f"llama-server {self.url} ({self.model.name}): 'timings' {timings!r:.200} is not numbers")

        def delta(name: str) -> int:
            return round(after.get(name, 0.0) - before.get(name, 0.0))

        name = "spec_decode_num_accepted_tokens_per_pos_total"
        per_before, per_after = before.get(name, []), after.get(name, [])
        per = [round(a - (per_before[i] if i < len(per_before) else 0.0)) for i, a in enumerate(per_after)]
        return Completion(
            tokens=self._tokens(reply),
            seconds=float(timings.get("predicted_ms", 0.0)) / 1000,
            prompt_seconds=float(timings.get("prompt_ms", 0.0)) / 1000,
            drafted=int(timings.get("draft_n", 0)),
            accepted=int(timings.get("draft_n_accepted", 0)),
            steps=delta("spec_decode_num_drafts_total"),
            accepted_per_position=per,
        )
