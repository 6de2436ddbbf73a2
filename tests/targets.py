"""Tiny random-weight targets of the architectures users serve, built from transformers' own config classes.

Each target is 8 decoder layers, 128 wide, 4 heads, with SmolLM2's tokenizer plus its family's special tokens and a
chat template written in its family's released style (what each does to the last turn, to reasoning, to the system
message). Nothing is downloaded: a target is built in a second or two and kept per session. The classes they cover,
not their names, are what the tests are about: sliding windows, MoE, MLA, composite multimodal configs, soft-capped
logits, untied and padded heads, a 128k vocabulary, templates that render the last turn differently, and hybrid
linear attention.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAYERS, WIDTH, HEADS = 8, 128, 4
# Wider than transformers' default initialisation, so a random target's logits have clear maxima: greedy identity
# between call shapes must not hinge on near-ties.
INIT_RANGE = 0.08

COMMON = {
    "hidden_size": WIDTH,
    "intermediate_size": 2 * WIDTH,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": 2,
    "head_dim": WIDTH // HEADS,
    "max_position_embeddings": 4096,
    "initializer_range": INIT_RANGE,
}

# -- chat templates, each in its family's released style --------------------------------------------------------------

CHATML_DEFAULT_SYSTEM = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3: reasoning kept only on assistant turns after the last user query; the last turn always gets a think block
# (empty when the message has no reasoning); `enable_thinking=false` puts the empty block into the generation prompt.
QWEN3 = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# Llama-3.1: a system block with the knowledge cut-off and today's date in every render; content trimmed.
LLAMA3 = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\n"
    "Today Date: 26 Jul 2024\\n\\n' + system + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Mistral v0.3: the system message goes into the user turn only when that turn is the last message; roles must
# alternate; a reply is trimmed and follows a space.
MISTRAL = (
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- if message.role == 'user' %}"
    "{%- if loop.last and system is defined %}{{- '[INST] ' + system + '\\n\\n' + message.content + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message.content + '[/INST]' }}{%- endif %}"
    "{%- else %}{{- ' ' + message.content | trim + eos_token }}{%- endif %}"
    "{%- endfor %}"
)

# Gemma: no system role (it opens the first user turn), the assistant is "model", roles must alternate. The frame
# around a turn's text is Gemma-2's and Gemma-3's alike.
GEMMA_TURNS = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set prefix = messages[0].content + '\\n\\n' %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set prefix = '' %}"
    "{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- set role = 'model' if message.role == 'assistant' else message.role %}"
)
GEMMA_END = "{%- endfor %}{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
GEMMA = (
    GEMMA_TURNS + "{{- '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + message.content | trim "
    "+ '<end_of_turn>\\n' }}" + GEMMA_END
)
# Gemma-3: Gemma's turns, with content as text or as parts, an image part written as its start-of-image token (which
# the processor expands into the image's tokens).
GEMMA3 = (
    GEMMA_TURNS + "{{- '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') }}"
    "{%- if message.content is string %}{{- message.content | trim }}"
    "{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' %}{{- '<start_of_image>' }}{%- elif part.type == 'text' %}{{- part.text | trim }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<end_of_turn>\\n' }}" + GEMMA_END
)

# Phi-3: the end-of-sequence token closes a conversation rendered without a generation prompt.
PHI3 = (
    "{%- for message in messages %}"
    "{{- '<|' + message.role + '|>\\n' + message.content + '<|end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- else %}{{- eos_token }}{%- endif %}"
)

# gpt-oss (harmony): the model writes the channel header; the last reply ends with <|return|>, earlier ones with
# <|end|>; reasoning (`thinking`) is kept only after the last user message; the system message is the developer's.
HARMONY = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n"
    "Knowledge cutoff: 2024-06\\n\\nReasoning: medium\\n\\n# Valid channels: analysis, commentary, final. "
    "Channel must be included for every message.<|end|>' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{{- '<|start|>developer<|message|># Instructions\\n\\n' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'user' %}{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}"
    "{%- else %}"
    "{%- if message.thinking and loop.index0 > ns.last_user %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}{%- endif %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content }}"
    "{%- if loop.last and not add_generation_prompt %}{{- '<|return|>' }}{%- else %}{{- '<|end|>' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)

DEEPSEEK = (
    "{{- bos_token }}{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<｜User｜>' + message.content }}"
    "{%- elif message.role == 'assistant' %}{{- '<｜Assistant｜>' + message.content + '<｜end▁of▁sentence｜>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}"
)

LLAMA4 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|header_start|>' + message.role + '<|header_end|>\\n\\n' + message.content | trim + '<|eot|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|header_start|>assistant<|header_end|>\\n\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class Template:
    text: str | None  # None: the tokenizer's own (SmolLM2's ChatML with its default system message)
    special: tuple[str, ...]  # tokens the family's tokenizer has and SmolLM2's lacks
    eos: tuple[str, ...]  # what generation stops at (the first is the tokenizer's eos)
    bos: str | None = None


CHATML = Template(CHATML_DEFAULT_SYSTEM, (), ("<|im_end|>",))
TEMPLATES = {
    "smollm2": Template(None, (), ("<|im_end|>",), bos="<|im_start|>"),
    "chatml": CHATML,
    "qwen3": Template(QWEN3, ("<think>", "</think>"), ("<|im_end|>", "<|endoftext|>")),
    "llama3": Template(
        LLAMA3,
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        ("<|eot_id|>", "<|end_of_text|>"),
        bos="<|begin_of_text|>",
    ),
    "mistral": Template(MISTRAL, ("<s>", "</s>", "[INST]", "[/INST]"), ("</s>",), bos="<s>"),
    "gemma": Template(
        GEMMA, ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), ("<end_of_turn>", "<eos>"), bos="<bos>"
    ),
    "gemma3": Template(
        GEMMA3, ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), ("<end_of_turn>", "<eos>"), bos="<bos>"
    ),
    "phi3": Template(PHI3, ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), ("<|endoftext|>", "<|end|>")),
    "harmony": Template(
        HARMONY,
        ("<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>", "<|call|>"),
        ("<|return|>", "<|call|>"),
    ),
    "deepseek": Template(
        DEEPSEEK,
        ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
        ("<｜end▁of▁sentence｜>",),
        bos="<｜begin▁of▁sentence｜>",
    ),
    "llama4": Template(
        LLAMA4,
        ("<|begin_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>"),
        ("<|eot|>",),
        bos="<|begin_of_text|>",
    ),
}


@dataclass(frozen=True)
class Arch:
    """One target of the matrix: its transformers model type, config values beside `COMMON`, and template."""

    name: str
    model_type: str
    template: str
    config: dict[str, Any] = field(default_factory=dict)
    classes: tuple[str, ...] = ()  # what it stands for: sliding window, MoE, MLA, multimodal, ...
    vocab: int = 49280  # the head's rows: past the tokenizer's ids, as Qwen pads them
    seed: int = 0  # added to the name's seed: a random target whose greedy reply repeats one token proves little
    # The final norm's weight: random weights give near-flat next-token distributions (top-1 about 0.001 of the mass),
    # where a trained model's are peaked; 8 gives a median top-1 of about 0.7, so a tree's budget follows its best
    # path as it does on a trained target. Greedy output does not change with it.
    final_norm: float | None = None
    # Ids past the first `frequent` have their (tied) embedding rows scaled by 0.6, so the head ranks them lower: about
    # 97% of the greedy tokens fall among the first 1,024 ids, as a trained model's fall among BPE's frequent merges,
    # where a reduced draft vocabulary can reach them. Random weights pick uniformly over 49k ids otherwise.
    frequent: int | None = None


MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": WIDTH, "norm_topk_prob": True}
# DeepSeek-V3's and GLM-4.5's routed experts (one group), dense before layer 1
ROUTED_MOE = {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1}
ROUTED_MOE.update(moe_intermediate_size=WIDTH, first_k_dense_replace=1)
VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}

MATRIX = [
    Arch("llama3", "llama", "llama3", {"tie_word_embeddings": False}, ("128k vocabulary", "untied head"), 128256),
    Arch("qwen2.5", "qwen2", "chatml", {"tie_word_embeddings": False}, ("attention bias", "padded head")),
    Arch("qwen3", "qwen3", "qwen3", {"tie_word_embeddings": True}, ("reasoning template", "q/k norm")),
    Arch("qwen3-moe", "qwen3_moe", "qwen3", {**MOE, "decoder_sparse_step": 1, "mlp_only_layers": []}, ("MoE",)),
    Arch("mistral", "mistral", "mistral", {"sliding_window": None}, ("system moved into the last user turn",)),
    Arch(
        "gemma2",
        "gemma2",
        "gemma",
        {"sliding_window": 16, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
        ("sliding window", "soft-capped logits", "1 + w norm"),
        seed=2,
    ),
    Arch(
        "gemma3-text",
        "gemma3_text",
        "gemma",
        {"sliding_window": 16, "layer_types": None},
        ("sliding window (5 of 6 layers)", "1 + w norm"),
    ),
    Arch(
        "gemma3",
        "gemma3",
        "gemma3",
        {"sliding_window": 16},
        ("multimodal wrapper", "sliding window"),
    ),
    Arch("phi3", "phi3", "phi3", {"tie_word_embeddings": False}, ("fused qkv",)),
    Arch(
        "granitemoe",
        "granitemoe",
        "chatml",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "logits_scaling": 8.0, "embedding_multiplier": 12.0},
        ("MoE", "logits divided by logits_scaling", "scaled embeddings"),
    ),
    Arch(
        "gpt-oss",
        "gpt_oss",
        "harmony",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16, "intermediate_size": WIDTH},
        ("MoE", "attention sinks", "sliding window", "harmony template"),
    ),
    Arch(
        "deepseek-v3",
        "deepseek_v3",
        "deepseek",
        {
            **ROUTED_MOE,
            "kv_lora_rank": 32,
            "q_lora_rank": 64,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 16,
            "v_head_dim": 32,
            "head_dim": 16,
            "num_key_value_heads": HEADS,
        },
        ("MLA", "MoE"),
    ),
    Arch(
        "glm4-moe",
        "glm4_moe",
        "chatml",
        {**ROUTED_MOE, "n_shared_experts": 1, "num_nextn_predict_layers": 1},
        ("MoE", "ships an MTP layer"),
    ),
    Arch(
        "qwen2.5-vl",
        "qwen2_5_vl",
        "chatml",
        {
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
        },
        ("multimodal wrapper", "M-RoPE"),
    ),
    Arch(
        "llama4",
        "llama4",
        "llama4",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "intermediate_size_mlp": 2 * WIDTH,
            "attention_chunk_size": 16,
        },
        ("multimodal wrapper", "MoE", "chunked attention"),
    ),
    Arch(
        "qwen3-next",
        "qwen3_next",
        "qwen3",
        {
            **MOE,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "shared_expert_intermediate_size": WIDTH,
            "full_attention_interval": 4,
        },
        ("hybrid linear attention",),
    ),
    Arch(
        "nemotron-h",
        "nemotron_h",
        "chatml",
        {
            "layers_block_type": ["linear_attention", "mlp", "full_attention", "mlp"] * 2,
            "mamba_num_heads": 8,
            "mamba_head_dim": 32,
            "ssm_state_size": 16,
            "n_groups": 2,
            "chunk_size": 16,
            "use_mamba_kernels": False,  # the CUDA kernels; transformers' torch path on CPU
            "mlp_hidden_act": "relu2",
        },
        ("hybrid Mamba", "blocks without a token mixer", "embeddings / norm_f"),
    ),
]
BY_NAME = {arch.name: arch for arch in MATRIX}

# The default test target: the embedded default's architecture class (Llama, tied head, SmolLM2's 49,152-token
# tokenizer and chat template as shipped) at the matrix's size, with random weights shaped as a trained model's
# statistics are (peaked next-token distributions over frequent ids). A stage on it takes a fraction of what
# SmolLM2-135M's 30 layers take; tests keep SmolLM2 only where the proof needs a trained model.
TINY = Arch(
    "tiny-llama",
    "llama",
    "smollm2",
    {"tie_word_embeddings": True},
    ("the default test target",),
    49152,
    final_norm=8.0,
    frequent=1024,
)


# Image tokens of the multimodal wrappers: (tokens added to the tokenizer, config key -> token).
IMAGE_TOKENS = {
    "gemma3": {
        "boi_token_index": "<start_of_image>",
        "eoi_token_index": "<end_of_image>",
        "image_token_index": "<image_soft_token>",
    },
    "qwen2_5_vl": {
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
    },
    "llama4": {
        "boi_token_index": "<|image_start|>",
        "eoi_token_index": "<|image_end|>",
        "image_token_index": "<|image|>",
    },
}
VISION_CONFIGS = {
    "gemma3": {**VISION, "image_size": 56, "patch_size": 14},
    "qwen2_5_vl": {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "out_hidden_size": WIDTH,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,
        "fullatt_block_indexes": [1],
    },
    "llama4": {
        **VISION,
        "image_size": 56,
        "patch_size": 14,
        "vision_output_dim": 64,
        "projector_input_dim": 64,
        "projector_output_dim": 64,
        "intermediate_layers_indices": [0],
        "pixel_shuffle_ratio": 0.5,
    },
}


def gemma3_processor(out: Path) -> None:
    """Gemma-3's processor beside its tokenizer: 56-pixel images, each read as `mm_tokens_per_image` (4) tokens
    between its start and end tokens, as the released processor writes 256."""
    from transformers import AutoTokenizer, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    names = ("boi_token", "eoi_token", "image_token")
    tokenizer = AutoTokenizer.from_pretrained(out, **dict(zip(names, IMAGE_TOKENS["gemma3"].values(), strict=True)))
    image_processor = Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
    Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4).save_pretrained(out)


# Processors the matrix ships (Qwen2.5-VL's and Llama-4's need torchvision, which is not installed: those targets
# stand for a multimodal checkpoint whose processor cannot be loaded).
PROCESSORS = {"gemma3": gemma3_processor}


def base_tokenizer_dir() -> str:
    """SmolLM2's tokenizer, from the embedded default target (converted once into the cache)."""
    from speculators_train.origin import TargetConfig, resolve_origin

    return resolve_origin(TargetConfig())[0]


def template_tokenizer(name: str, extra: tuple[str, ...] = ()):
    """SmolLM2's tokenizer with template `name`'s special tokens (and `extra` ones), end and start tokens, and
    chat template."""
    from transformers import AutoTokenizer

    template = TEMPLATES[name]
    tokenizer = AutoTokenizer.from_pretrained(base_tokenizer_dir())
    tokenizer.add_special_tokens({"additional_special_tokens": [*template.special, *extra]})
    tokenizer.eos_token = template.eos[0]
    if template.bos:
        tokenizer.bos_token = template.bos
    if template.text is not None:
        tokenizer.chat_template = template.text
    return tokenizer


def config_of(arch: Arch, tokenizer=None):
    """`arch`'s transformers config (its `architectures` named as `save_pretrained` names them), for a tokenizer
    with its template's tokens (default: `template_tokenizer`'s)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    template = TEMPLATES[arch.template]
    images = IMAGE_TOKENS.get(arch.model_type, {})
    tokenizer = tokenizer or template_tokenizer(arch.template, tuple(images.values()))
    special = {
        "eos_token_id": [tokenizer.convert_tokens_to_ids(t) for t in template.eos],
        "bos_token_id": tokenizer.bos_token_id,
        "pad_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }
    text = {**COMMON, **arch.config, "vocab_size": arch.vocab, **special}
    if arch.model_type in VISION_CONFIGS:
        ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in images.items()}
        extra = {"mm_tokens_per_image": 4} if arch.model_type == "gemma3" else {}
        tie = {"tie_word_embeddings": text.pop("tie_word_embeddings", False)}
        vision = VISION_CONFIGS[arch.model_type]
        config = AutoConfig.for_model(
            arch.model_type, text_config=text, vision_config=vision, **ids, **extra, **tie, **special
        )
        auto = AutoModelForImageTextToText
    else:
        config = AutoConfig.for_model(arch.model_type, **text)
        auto = AutoModelForCausalLM
    config.architectures = [auto._model_mapping[type(config)].__name__]
    return config


def build(arch: Arch, out: Path) -> Path:
    """Write `arch` as a model folder (config, safetensors weights, tokenizer with its chat template) at `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    images = IMAGE_TOKENS.get(arch.model_type, {})
    tokenizer = template_tokenizer(arch.template, tuple(images.values()))
    assert len(tokenizer) <= arch.vocab, (arch.name, len(tokenizer))
    config = config_of(arch, tokenizer)
    torch.manual_seed(sum(map(ord, arch.name)) + arch.seed)
    auto = AutoModelForImageTextToText if arch.model_type in VISION_CONFIGS else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        if arch.final_norm is not None:
            model.get_decoder().norm.weight.fill_(arch.final_norm)
        if arch.frequent is not None:
            model.get_input_embeddings().weight[arch.frequent :] *= 0.7
    generation = model.generation_config
    generation.eos_token_id, generation.bos_token_id = config.get_text_config().eos_token_id, tokenizer.bos_token_id
    generation.pad_token_id = config.get_text_config().pad_token_id
    model.save_pretrained(out)
    if arch.config.get("num_nextn_predict_layers"):
        add_mtp_layers(config, out, arch.config["num_nextn_predict_layers"])
    tokenizer.save_pretrained(out)
    if arch.model_type in PROCESSORS:
        PROCESSORS[arch.model_type](out)
    (out / "matrix.json").write_text(json.dumps({"name": arch.name, "classes": list(arch.classes)}))
    return out


def add_mtp_layers(config, out: Path, count: int) -> None:
    """The MTP layers a checkpoint ships beside its n decoder layers, which transformers neither builds nor saves, in
    its makers' layout: layers of the model's own class (initialised as the model initialises them, in the
    checkpoint's own tensor names), full attention where the model has layer kinds. DeepSeek-V3's: layers n.. with
    `enorm`, `hnorm`, `eh_proj` and `shared_head.norm`; Qwen3-Next's: `mtp.layers.{i}` with
    `mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm}`, its norms zero-centred (1 + w)."""
    import copy
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    n, width = config.num_hidden_layers, config.hidden_size
    longer = copy.deepcopy(config)
    longer.num_hidden_layers = n + count
    if getattr(config, "layer_types", None):
        longer.layer_types = [*config.layer_types, *["full_attention"] * count]
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(longer, dtype=torch.float32).save_pretrained(tmp)
        extra = {k: v for k, v in load_file(Path(tmp) / "model.safetensors").items() if k.startswith("model.layers.")}
    weights = load_file(out / "model.safetensors")
    qwen = config.model_type == "qwen3_next"
    norms = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm") if qwen else ("enorm", "hnorm", "shared_head.norm")
    for i in range(n, n + count):
        layer, prefix = f"model.layers.{i}.", f"mtp.layers.{i - n}." if qwen else f"model.layers.{i}."
        weights.update({prefix + k[len(layer) :]: v for k, v in extra.items() if k.startswith(layer)})
        around = "mtp." if qwen else prefix  # Qwen3-Next's one set of norms and fc serves every MTP layer
        weights.update({around + f"{norm}.weight": (torch.zeros if qwen else torch.ones)(width) for norm in norms})
        fc = torch.randn(width, 2 * width) * config.initializer_range
        weights[around + ("fc.weight" if qwen else "eh_proj.weight")] = fc
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})


def text_decoder_folder(src: Path, out: Path) -> Path:
    """A multimodal checkpoint's language model saved as a causal-LM folder of its own (with the tokenizer): what a
    user serves where an engine runs the text decoder but not the vision tower."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from speculators_train.architectures import model_class

    model = model_class(AutoConfig.from_pretrained(src)).from_pretrained(src, dtype=torch.float32)
    model.language_model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


_TINY_DIR: list[Path] = []


def tiny_target() -> Path:
    """TINY's model folder, built once per test session (about a second) and removed when the session ends."""
    if not _TINY_DIR:
        import atexit
        import shutil
        import tempfile

        root = Path(tempfile.mkdtemp(prefix="tiny-target-"))
        atexit.register(shutil.rmtree, root, True)
        _TINY_DIR.append(build(TINY, root / TINY.name))
    return _TINY_DIR[0]
