"""Whether llama-server serves a family's draft on a target, asked of llama.cpp's own code: its converter names the
GGUF architecture an HF target becomes, and a draft that reads intermediate states needs that architecture's graph
to export layer inputs (`t_layer_inp` in the model's source, read from the archive the programs are built from).
A GGUF target's architecture is read from its file's header."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

from speculators_train import children
from speculators_train.engines.serving import FACTS_LAYOUT, Serving, cached

# Run with llama.cpp's converter on the path (its own gguf-py first). argv: the converter's folder, architectures.
_CONVERTER_PROBE = r"""
import json, sys
from pathlib import Path

root = Path(sys.argv[1])
sys.path[:0] = [str(root / "gguf-py"), str(root)]
import gguf
from conversion import get_model_class

out = {}
for arch in sys.argv[2:]:
    try:
        cls = get_model_class(arch)  # the text model's converter class
    except NotImplementedError:  # the converter's answer for an architecture it has no class for
        out[arch] = None
        continue
    out[arch] = gguf.MODEL_ARCH_NAMES[cls.model_arch]
print(json.dumps(out))
"""


def converted_architecture(architecture: str) -> str | None:
    """The GGUF architecture llama.cpp's converter writes an HF `architecture` as (None: it converts no such
    model)."""
    from speculators_train.engines.llamacpp.build import version
    from speculators_train.engines.llamacpp.converter import ensure_converter

    def probe() -> str | None:
        root = ensure_converter().parent
        cmd = [sys.executable, "-c", _CONVERTER_PROBE, str(root), architecture]
        proc = children.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise subprocess.SubprocessError(proc.stderr[-500:])
        return json.loads(proc.stdout.strip().splitlines()[-1])[architecture]

    return cached("llama.cpp", f"{version()}:convert-{FACTS_LAYOUT}:{architecture}", probe)


def _source_files(archive: Path) -> dict[str, str]:
    """The llama.cpp sources that decide which architectures export layer inputs, read from the sdist."""
    wanted = re.compile(r"vendor/llama\.cpp/src/(llama-arch\.cpp|llama-model\.cpp|models/[\w.-]+\.(cpp|h))$")
    out = {}
    with tarfile.open(archive) as tar:
        for member in tar:
            match = wanted.search(member.name)
            if match and member.isfile():
                out[match.group(1)] = tar.extractfile(member).read().decode("utf-8", "replace")
    return out


def layer_input_architectures(sources: dict[str, str]) -> list[str]:
    """GGUF architectures whose graph exports each layer's input (`res->t_layer_inp`), which a draft reading the
    target's intermediate states needs: arch name -> LLM_ARCH enum (llama-arch.cpp) -> model class (llama-model.cpp's
    mapping) -> the source that builds its graph, or its parent's (models.h)."""
    names = dict(re.findall(r'\{\s*(LLM_ARCH_\w+)\s*,\s*"([^"]+)"\s*\}', sources["llama-arch.cpp"]))
    classes: dict[str, str] = {}
    pending: list[str] = []
    for case, made in re.findall(
        r"case\s+(LLM_ARCH_\w+)\s*:|return\s+new\s+(llama_model_\w+)\s*\(", sources["llama-model.cpp"]
    ):
        if case:
            pending.append(case)
        else:
            classes.update(dict.fromkeys(pending, made))
            pending = []
    parents = dict(
        re.findall(r"struct\s+(llama_model_\w+)\s*:\s*public\s+(llama_model_\w+)", sources.get("models/models.h", ""))
    )
    builds: dict[str, bool] = {}
    for name, text in sources.items():
        if name.startswith("models/") and name.endswith(".cpp"):
            for cls in re.findall(r"(llama_model_\w+)::build_arch_graph", text):
                builds[cls] = "t_layer_inp" in text

    def exports(cls: str) -> bool:
        while cls not in builds and cls in parents:
            cls = parents[cls]
        return builds.get(cls, False)

    return sorted(names[enum] for enum, cls in classes.items() if enum in names and exports(cls))


def _layer_input_archs() -> list[str] | None:
    """`layer_input_architectures` of the llama.cpp this toolkit builds (None: its archive is not here yet)."""
    from speculators_train.engines.llamacpp.build import home, version

    archives = sorted((home() / "sdist").glob("*.tar.gz"))
    if not archives:
        return None
    return cached(
        "llama.cpp", f"{version()}:layer-inputs", lambda: layer_input_architectures(_source_files(archives[0]))
    )


def llamacpp_serving(target_config: Any, gguf_architecture: str | None, reads_target_states: bool) -> Serving:
    """Whether llama-server serves a draft on this target, whose GGUF architecture is `gguf_architecture` (the
    target's own GGUF file) or, for an HF target, what llama.cpp's converter makes of it."""
    out = Serving("llama.cpp")
    architecture = (getattr(target_config, "architectures", None) or ["LlamaForCausalLM"])[0]
    arch = gguf_architecture or converted_architecture(architecture)
    if arch is None:
        out.problems.append(f"llama.cpp's converter converts no {architecture} model")
        return out
    if reads_target_states:
        exporting = _layer_input_archs()
        if exporting is None:
            out.here.append(
                "llama.cpp's sources are not here yet to check which targets export layer inputs (fetched on first use)"
            )
        elif arch not in exporting:
            out.problems.append(
                f"llama.cpp's {arch} graph does not export layer inputs, which a draft reading the target's "
                "intermediate states needs (llama-server aborts)"
            )
    return out


def gguf_architecture(target: Any) -> str | None:
    """`general.architecture` of the recipe's target when it is a GGUF file (what llama-server runs), else None."""
    from speculators_train.origin import gguf_file

    path = gguf_file(target)
    if path is None or not path.is_file():
        return None
    leading = leading_string(path, "general.architecture")
    if leading is not None:
        return leading
    from gguf import GGUFReader

    field = GGUFReader(path).fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def leading_string(path: Path, key: str) -> str | None:
    """`key`'s value when it comes before the first array among a little-endian GGUF file's metadata, where
    llama.cpp's writers put `general.architecture`: read from the header alone, not through the vocabulary after it
    (GGUFReader parses every field, seconds for a 49k-token vocabulary). None when it does not (read it whole)."""
    import struct

    import numpy as np
    from gguf import GGUFReader
    from gguf.constants import GGUF_MAGIC, GGUFValueType

    def unpack(fmt: str, fh: Any) -> tuple:
        return struct.unpack(fmt, fh.read(struct.calcsize(fmt)))

    def text(fh: Any) -> bytes:
        (length,) = unpack("<Q", fh)
        if length > 1 << 16:  # a key or a short value; anything longer is another byte order or damage
            raise ValueError(length)
        return fh.read(length)

    wanted = key.encode()
    try:
        with path.open("rb") as fh:
            magic, version = unpack("<II", fh)
            if magic != GGUF_MAGIC or not 2 <= version <= 0xFFFF:  # a big-endian file's version reads byte-swapped
                return None
            _, count = unpack("<QQ", fh)
            for _ in range(count):
                name, kind = text(fh), unpack("<I", fh)[0]
                if kind == GGUFValueType.STRING:
                    value = text(fh)
                    if name == wanted:
                        return value.decode()
                elif kind in GGUFReader.gguf_scalar_to_np:
                    fh.seek(np.dtype(GGUFReader.gguf_scalar_to_np[kind]).itemsize, 1)
                else:
                    return None
    except (struct.error, ValueError):  # UnicodeDecodeError is a ValueError
        return None
    return None
