"""Which engine serves which draft on which target, asked of the engines' own code: vLLM's registry and
`SupportsEagle3`, llama.cpp's converter and model sources. Each rule is checked against a fact found by hand in
that engine (SPEC.md sections 10 and 15)."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from speculators_train.engines import serving
from speculators_train.engines.llamacpp import serving as llamacpp
from speculators_train.engines.vllm import serving as vllm


def config(model_type: str, architecture: str, **values):
    out = AutoConfig.for_model(model_type, **values)
    out.architectures = [architecture]
    return out


@pytest.fixture(scope="module")
def llamacpp_archive():
    """llama.cpp's converter and sources, taken from the archive its programs are built from (no build needed)."""
    from speculators_train.engines.llamacpp.converter import ensure_converter

    ensure_converter()


def test_llamacpp_graphs_that_export_layer_inputs_are_read_from_its_sources(llamacpp_archive):
    """llama.cpp runs an EAGLE-3 or DFlash draft only on a target whose graph sets `t_layer_inp`: Llama, Qwen3,
    Qwen3-MoE and gpt-oss do in the vendored release; Qwen2, Gemma-3, Phi-3 and Llama-4 do not (llama-server
    aborts on them)."""
    exporting = llamacpp._layer_input_archs()
    assert {"llama", "qwen3", "qwen3moe", "gpt-oss"} <= set(exporting)
    assert not {"qwen2", "gemma3", "phi3", "llama4"} & set(exporting)


def test_llamacpp_converter_names_the_gguf_architecture_of_an_hf_target(llamacpp_archive):
    assert llamacpp.converted_architecture("Qwen2ForCausalLM") == "qwen2"
    assert llamacpp.converted_architecture("GptOssForCausalLM") == "gpt-oss"
    assert llamacpp.converted_architecture("NoSuchModelForCausalLM") is None


def test_llamacpp_refuses_a_state_reading_draft_on_a_target_that_exports_no_layer_inputs(llamacpp_archive):
    qwen2 = config("qwen2", "Qwen2ForCausalLM")
    answer = llamacpp.llamacpp_serving(qwen2, None, reads_target_states=True)
    assert answer.problems and "qwen2 graph does not export layer inputs" in answer.problems[0]
    assert llamacpp.llamacpp_serving(qwen2, None, reads_target_states=False).runs_here  # a plain draft model
    assert llamacpp.llamacpp_serving(config("llama", "LlamaForCausalLM"), None, True).runs_here


@pytest.fixture(scope="module")
def vllm_answers():
    """vLLM asked once for every architecture below (one child process; answers cached per vLLM version)."""
    archs = ["LlamaForCausalLM", "Gemma2ForCausalLM", "DeepseekV3ForCausalLM", "Qwen2_5_VLForConditionalGeneration"]
    archs += ["Glm4MoeForCausalLM", "Qwen3NextForCausalLM", "PhimoeForCausalLM", "HeliumForCausalLM"]
    return vllm.vllm_facts(archs)


def test_vllm_needs_supports_eagle3_for_a_draft_that_reads_target_states(vllm_answers):
    """vLLM 0.32 runs Gemma-2 as its own Gemma2ForCausalLM, which does not implement SupportsEagle3: EAGLE-3,
    P-EAGLE and DFlash drafts are refused; a Medusa head or a draft model (no intermediate states) is not."""
    gemma2 = config("gemma2", "Gemma2ForCausalLM")
    answer = vllm.vllm_serving(gemma2, reads_target_states=True, own_attention=True)
    assert answer.problems and "SupportsEagle3" in answer.problems[0]
    assert not vllm.vllm_serving(gemma2, reads_target_states=False, own_attention=False).problems
    assert vllm.vllm_serving(config("llama", "LlamaForCausalLM"), True, True).runs_here


def test_vllm_refuses_a_target_whose_linear_forward_its_transformers_backend_drops(vllm_answers):
    """vLLM 0.32 registers no `PhimoeForCausalLM` (transformers' name; vLLM's class is `PhiMoEForCausalLM`), so it
    runs PhiMoE on its Transformers backend, which swaps the router (an nn.Linear with a forward of its own) for a
    plain linear: measured by hand on a tiny PhiMoE, vLLM loads it and fails at the first forward unpacking the
    router's answer. Helium, on the same backend with plain linears, is not refused."""
    phimoe = config("phimoe", "PhimoeForCausalLM")
    for reads, own in ((True, True), (False, False)):  # the target itself: every family
        answer = vllm.vllm_serving(phimoe, reads_target_states=reads, own_attention=own)
        assert answer.problems and "PhimoeTopKRouter would lose the forward of its own" in answer.problems[0]
    helium = vllm_answers["HeliumForCausalLM"]
    assert not helium["registered"] and helium["lost_forwards"] == []
    assert not vllm.vllm_serving(config("helium", "HeliumForCausalLM"), True, True).problems


def test_vllm_on_cpu_cannot_pair_an_mla_target_with_a_draft_of_its_own_attention(vllm_answers):
    deepseek = config("deepseek_v3", "DeepseekV3ForCausalLM")
    answer = vllm.vllm_serving(deepseek, reads_target_states=True, own_attention=True)
    assert not answer.problems  # a GPU build serves it
    if vllm_answers["DeepseekV3ForCausalLM"]["cpu"]:
        assert answer.here and "MLA" in answer.here[0]
    assert not vllm.vllm_serving(deepseek, reads_target_states=False, own_attention=False).here


def test_vllm_serves_an_mtp_head_only_where_it_maps_the_target_to_an_mtp_class_of_the_heads_style(vllm_answers):
    """vLLM's own `hf_config_override` names the MTP class for each target: GLM-4.5's and DeepSeek-V3's run a
    `deepseek`-style head in its layout, Qwen3-Next's a `qwen3_next` one in `mtp.*`; Llama has none."""
    from speculators_train.families.mtp.settings import STYLE_CLASSES

    deepseek, qwen = STYLE_CLASSES["deepseek"], STYLE_CLASSES["qwen3_next"]
    glm = config("glm4_moe", "Glm4MoeForCausalLM")
    assert vllm.vllm_serving(glm, False, False, nextn_classes=deepseek).runs_here
    other = vllm.vllm_serving(glm, False, False, nextn_classes=qwen)
    assert other.problems and "with Glm4MoeMTPModel, whose weight layout is not this export's" in other.problems[0]
    none = vllm.vllm_serving(config("llama", "LlamaForCausalLM"), False, False, nextn_classes=deepseek)
    assert none.problems == [
        "vLLM has no MTP model for the target's architecture (its `hf_config_override` maps it to none)"
    ]
    next_ = config("qwen3_next", "Qwen3NextForCausalLM")
    assert not vllm.vllm_serving(next_, False, False, nextn_classes=qwen).problems
    other = vllm.vllm_serving(next_, False, False, nextn_classes=deepseek)
    assert other.problems and "with Qwen3NextMTP, whose weight layout is not this export's" in other.problems[0]
    v3 = config("deepseek_v3", "DeepseekV3ForCausalLM")
    assert not vllm.vllm_serving(v3, False, False, nextn_classes=deepseek).problems


def test_a_multimodal_class_vllm_cannot_load_here_is_said_to_fail_here_only(vllm_answers):
    """vLLM's multimodal classes import image processors that need torchvision, which the CPU torch here cannot
    have: serving them is a question of this machine, not of the draft."""
    vl = AutoConfig.for_model("qwen2_5_vl")
    vl.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    answer = vllm.vllm_serving(vl, reads_target_states=True, own_attention=True)
    assert not answer.problems
    if "error" in vllm_answers["Qwen2_5_VLForConditionalGeneration"]:
        assert answer.here and "cannot load" in answer.here[0]


# vLLM's own MLP classes, built as its draft layers build them (one tensor-parallel rank, gloo): which activations
# each takes. In a child: importing vLLM changes process-wide settings.
_MLP_PROBE = r"""
import json, socket, sys
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.models.llama import LlamaMLP
from vllm.model_executor.models.qwen2 import Qwen2MLP

s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
out = {}
with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
    initialize_model_parallel(1, 1)
    for cls in (LlamaMLP, Qwen2MLP):
        for act in sys.argv[1:]:
            try:
                cls(hidden_size=8, intermediate_size=16, hidden_act=act)
                out[f"{cls.__name__}:{act}"] = True
            except ValueError:
                out[f"{cls.__name__}:{act}"] = False
print(json.dumps(out))
"""


def test_vllm_serves_a_draft_of_its_own_layers_only_in_the_activations_its_mlps_build():
    """EAGLE-3, P-EAGLE and DFlash drafts take the target's activation; vLLM builds their layers from its `LlamaMLP`
    and `Qwen2MLP`, which refuse any activation but SiLU: a Gemma target's draft (gelu_pytorch_tanh) gets no vLLM
    line. The rule is `VLLM_DRAFT_ACTIVATIONS`; vLLM's classes are asked here, so a vLLM that widens it fails this."""
    import json
    import subprocess
    import sys

    acts = ["silu", "gelu_pytorch_tanh", "gelu", "relu2"]
    proc = subprocess.run([sys.executable, "-c", _MLP_PROBE, *acts], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    built = json.loads(proc.stdout.strip().splitlines()[-1])
    for act in acts:
        assert built[f"LlamaMLP:{act}"] == built[f"Qwen2MLP:{act}"] == (act in vllm.VLLM_DRAFT_ACTIVATIONS), act
    gemma3 = config("gemma3_text", "Gemma3ForCausalLM")
    answer = vllm.vllm_serving(gemma3, reads_target_states=True, own_attention=True)
    assert answer.problems[-1].endswith("the draft has the target's activation, gelu_pytorch_tanh")
    assert not vllm.vllm_serving(gemma3, reads_target_states=False, own_attention=False).problems  # a draft model


def test_export_prints_only_the_serve_lines_that_run():
    """A line whose engine cannot serve the draft is left out with a note naming the reason; one that needs
    another machine is printed with a note; another engine's line (SGLang) is kept as written."""
    from speculators_train.families.eagle3.settings import Settings

    gemma2 = config("gemma2", "Gemma2ForCausalLM")

    class Target:  # a recipe target that is no GGUF file
        name_or_path = "/nowhere"
        gguf_file = None

    lines = ["vllm serve google/gemma-2 --speculative-config '{}'", "python -m sglang.launch_server --model x"]
    kept, notes = serving.served_commands(Target(), gemma2, Settings(), lines)
    assert kept == lines[1:] and len(notes) == 1 and notes[0].startswith("no vllm command: ")
