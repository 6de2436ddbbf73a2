"""llama.cpp's programs on this machine, built once from source and kept in the cache.

Kept apart from the converter (`converter.py`) and the server client (`server.py`) because building is a one-time,
slow, locked step with its own failure modes (no compiler, no network), which they only wait on.

Where the programs come from: the llama-cpp-python source distribution (a dependency of the embedded default
target's package) vendors a whole llama.cpp. Its archive is fetched from the package index (`pip download
--no-binary`, no other network), its `llama-server` and `llama-bench` are built with cmake and the machine's C++
compiler, statically linked and tuned for this CPU (GGML_NATIVE), and kept under

    <cache>/llama.cpp/<llama-cpp-python version>-<machine>/bin/      the programs
                                                          /convert/  convert_hf_to_gguf.py with its own gguf-py

so every later run starts at once. The version is the installed llama-cpp-python's, so the programs match the
library the package index gives this project. SPECULATORS_TRAIN_LLAMA_CPP_BIN names a directory holding a
user's own build instead (the converter still comes from the archive).
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

from filelock import FileLock

from speculators_train import children
from speculators_train.errors import UserError
from speculators_train.origin import cache_root

log = logging.getLogger(__name__)

PACKAGE = "llama-cpp-python"
KNOWN_VERSION = "0.3.36"  # the sdist SPEC.md section 10 describes; used when the package is not installed
TOOLS = ("llama-server", "llama-bench")
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


def locked(path: Path) -> FileLock:
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
        with locked(root.with_name(root.name + ".lock")):
            if not ready():
                _build_programs(root)
    return bin_dir


def vendored_source(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    logfile = root / "build.log"
    return _extract_vendored(_fetch_sdist(root / "sdist", logfile), root / "src")


def _build_programs(root: Path) -> None:
    _check_toolchain()
    source = vendored_source(root)
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
