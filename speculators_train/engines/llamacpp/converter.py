"""llama.cpp's own GGUF converter, `convert_hf_to_gguf.py`, taken from the same archive the programs are built from.

Kept apart from the build (`build.py`) because the converter needs no compiler, only the archive: an export to GGUF
or a verify run on an HF target converts without waiting on, or failing for, a build of llama-server. It runs with
its own gguf-py (which knows the EAGLE-3 arch), never the `gguf` package installed here.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from speculators_train import children
from speculators_train.engines.llamacpp.build import home, locked, vendored_source
from speculators_train.errors import UserError

CONVERTER = ("convert_hf_to_gguf.py", "conversion", "gguf-py")
OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # its --outtype for each export dtype


def ensure_converter() -> Path:
    """llama.cpp's `convert_hf_to_gguf.py` (with its own gguf-py), taken from the archive on the first call; it
    needs no build."""
    root = home()
    script = root / "convert" / CONVERTER[0]
    if not script.is_file():
        with locked(root.with_name(root.name + ".lock")):
            if not script.is_file():
                _install_converter(root)
    return script


def _install_converter(root: Path) -> None:
    source = vendored_source(root)
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
        # reaped: a converter left running by a killed export would write into the folder a rerun starts over
        proc = children.run(cmd, reap=True, capture_output=True, text=True, env=env)
    except BaseException:  # Ctrl-C or SIGTERM: the converter is ended, its half-written file removed
        tmp.unlink(missing_ok=True)
        raise
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise UserError(f"llama.cpp's converter could not convert {model_dir}:\n{tail}")
    os.replace(tmp, out)
    return out
