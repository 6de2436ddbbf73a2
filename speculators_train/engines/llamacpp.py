"""llama.cpp on this machine: its programs built once from source, its GGUF converter, and a server to decode with.

Where the programs come from: the llama-cpp-python source distribution (a dependency of the embedded default
target's package) vendors a whole llama.cpp. Its archive is fetched from the package index (`pip download
--no-binary`, no other network), its `llama-server` and `llama-bench` are built with cmake and the machine's C++
compiler, statically linked and tuned for this CPU (GGML_NATIVE), and kept under

    <cache>/llama.cpp/<llama-cpp-python version>-<machine>/bin/      the programs
                                                          /convert/  convert_hf_to_gguf.py with its own gguf-py

so every later run starts at once. The version is the installed llama-cpp-python's, so the programs match the
library the package index gives this project. SPECULATORS_TRAIN_LLAMA_CPP_BIN names a directory holding a
user's own build instead (the converter still comes from the archive).

A server here decodes one request at a time, greedily, with prompt caching off, and reports per request what
llama.cpp counted: generated tokens, decode time, drafted and accepted tokens, verify steps and acceptance per
draft position (from /metrics, before and after the request).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from filelock import FileLock

from speculators_train import children
from speculators_train.errors import UserError
from speculators_train.sources import cache_root

log = logging.getLogger(__name__)

PACKAGE = "llama-cpp-python"
KNOWN_VERSION = "0.3.36"  # the sdist SPEC.md section 10 describes; used when the package is not installed
TOOLS = ("llama-server", "llama-bench")
CONVERTER = ("convert_hf_to_gguf.py", "conversion", "gguf-py")
BIN_ENV = "SPECULATORS_TRAIN_LLAMA_CPP_BIN"
# cmake switches: no network at build or run time (no curl/openssl, no prebuilt web UI), static programs that
# survive the build tree being deleted, and kernels for this CPU.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
)


def version() -> str:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return KNOWN_VERSION


def home() -> Path:
    return cache_root() / "llama.cpp" / f"{version()}-{platform.machine()}"


def _locked(path: Path) -> FileLock:
    """One builder at a time (two test processes, or two users of one cache); the second waits, then finds the
    finished build."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(path)


def _run(cmd: list[str], logfile: Path, what: str) -> None:
    with open(logfile, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        code = children.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = "\n".join(logfile.read_text(errors="replace").splitlines()[-15:])
        raise UserError(f"llama.cpp: {what} failed (exit {code}); full log in {logfile}:\n{tail}")


def _fetch_sdist(dest: Path, logfile: Path) -> Path:
    """The llama-cpp-python source archive from the package index (only the index: no git, no hub)."""
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        _run(
            [sys.executable, "-m", "pip", "download", f"{PACKAGE}=={version()}", "--no-deps", "--no-binary", ":all:",
             "-d", str(dest)],
            logfile,
            f"downloading the {PACKAGE} {version()} source archive from the package index",
        )  # fmt: skip
        found = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        raise UserError(f"llama.cpp: pip downloaded no {PACKAGE} source archive into {dest} (log: {logfile})")
    return found[-1]


def _extract_vendored(archive: Path, dest: Path) -> Path:
    """vendor/llama.cpp of the archive, extracted with tarfile's data filter (no links out, no device files)."""
    shutil.rmtree(dest, ignore_errors=True)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
        if not members:
            raise UserError(f"llama.cpp: {archive} holds no vendor/llama.cpp (not a llama-cpp-python sdist?)")
        tar.extractall(dest, members=members, filter="data")
    (source,) = {Path(m.name).parts[0] for m in members}
    return dest / source / "vendor" / "llama.cpp"


def _check_toolchain() -> None:
    missing = []
    if shutil.which("cmake") is None:
        missing.append("cmake (apt install cmake, or pip install cmake)")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (apt install g++)")
    if missing:
        raise UserError(f"llama.cpp: building its programs needs {' and '.join(missing)}")


def ensure_built() -> Path:
    """The directory of llama-server and llama-bench, built on the first call (or the user's, from BIN_ENV)."""
    user_bin = os.environ.get(BIN_ENV)
    if user_bin:
        missing = [tool for tool in TOOLS if not (Path(user_bin) / tool).is_file()]
        if missing:
            raise UserError(f"{BIN_ENV}={user_bin}: {missing} not there")
        return Path(user_bin)
    root = home()
    bin_dir = root / "bin"

    def ready() -> bool:
        return all((bin_dir / tool).is_file() for tool in TOOLS)

    if not ready():
        with _locked(root.with_name(root.name + ".lock")):
            if not ready():
                _build_programs(root)
    return bin_dir


def ensure_converter() -> Path:
    """llama.cpp's `convert_hf_to_gguf.py` (with its own gguf-py), taken from the archive on the first call; it
    needs no build."""
    root = home()
    script = root / "convert" / CONVERTER[0]
    if not script.is_file():
        with _locked(root.with_name(root.name + ".lock")):
            if not script.is_file():
                _install_converter(root)
    return script


def _source(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    logfile = root / "build.log"
    return _extract_vendored(_fetch_sdist(root / "sdist", logfile), root / "src")


def _build_programs(root: Path) -> None:
    _check_toolchain()
    source = _source(root)
    logfile = root / "build.log"
    log.warning("building llama.cpp %s once into %s (10-20 minutes on 2 cores)", version(), root / "bin")
    build = root / "build"
    shutil.rmtree(build, ignore_errors=True)
    jobs = str(len(os.sched_getaffinity(0)))
    _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS], logfile, "cmake configure")
    _run(["cmake", "--build", str(build), "-j", jobs, "--target", *TOOLS], logfile, "cmake build")
    staged = root / "bin.tmp"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir()
    for tool in TOOLS:
        shutil.copy2(build / "bin" / tool, staged / tool)
    shutil.rmtree(root / "bin", ignore_errors=True)
    os.replace(staged, root / "bin")
    shutil.rmtree(build, ignore_errors=True)
    shutil.rmtree(root / "src", ignore_errors=True)


def _install_converter(root: Path) -> None:
    source = _source(root)
    staged = root / "convert.tmp"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir()
    for name in CONVERTER:
        src = source / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, staged / name)
    shutil.rmtree(root / "convert", ignore_errors=True)
    os.replace(staged, root / "convert")
    shutil.rmtree(root / "src", ignore_errors=True)


def convert(model_dir: Path, out: Path, outtype: str = "f32", target_dir: Path | None = None) -> Path:
    """`convert_hf_to_gguf.py` from the same llama.cpp: an HF (or, with `target_dir`, an EAGLE-3 draft)
    directory as one GGUF file, written beside `out` and renamed into place."""
    script = ensure_converter()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    cmd = [sys.executable, str(script), str(model_dir), "--outfile", str(tmp), "--outtype", outtype]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    # The converter must use its own gguf-py (it knows the EAGLE-3 arch), not the `gguf` package installed here.
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    try:
        proc = children.run(cmd, capture_output=True, text=True, env=env)
    except BaseException:  # Ctrl-C or SIGTERM: the converter is ended, its half-written file removed
        tmp.unlink(missing_ok=True)
        raise
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise UserError(f"llama.cpp's converter could not convert {model_dir}:\n{tail}")
    os.replace(tmp, out)
    return out


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


if __name__ == "__main__":  # `make llama-cpp`: build (or find) the programs and say where they are
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        ensure_converter()
        print(ensure_built())
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
