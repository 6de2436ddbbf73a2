"""What a target's architecture is, read through its own config and classes, never through one family's field names.

A multimodal checkpoint (Gemma-3, Qwen2.5-VL, Llama-4 as users download them) has a composite config whose text
decoder is the target: sizes come from `get_text_config()`, the model is loaded through the class its config
names (`architectures`), and its text decoder is found through `get_decoder()`. Field names that differ between
families (Gemma's `hidden_activation`, per-layer-type RoPE) are read here, in one place.
"""

from __future__ import annotations

from typing import Any

from speculators_train.errors import UserError

# Where a config keeps its MLP activation: Llama and most families `hidden_act`, Gemma `hidden_activation`.
ACTIVATION_KEYS = ("hidden_act", "hidden_activation", "activation_function")
# Layer kinds whose state a cache cannot roll back by cropping (a recurrent or linear-attention state).
RECURRENT_LAYERS = frozenset({"linear_attention", "mamba", "conv", "recurrent", "rwkv"})
# Blocks without a token mixer (Nemotron-H's MLP and MoE layers): nothing cached, nothing to mask.
MIXERLESS_LAYERS = frozenset({"mlp", "moe"})
CAUSAL_ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
PAD_EXACT_LAYERS = CAUSAL_ATTENTION_LAYERS | RECURRENT_LAYERS | MIXERLESS_LAYERS


def text_config(config: Any) -> Any:
    """The text decoder's config (the config itself for a text-only model)."""
    return config.get_text_config()


def is_composite(config: Any) -> bool:
    """Whether the text decoder is one part of a larger (multimodal) model."""
    return text_config(config) is not config


def model_class(config: Any, trust_remote_code: bool = False) -> Any:
    """The class to load the target as: the class its config names (a multimodal wrapper loads as itself, so its
    checkpoint's tensors are all described), else transformers' causal-LM (or image-text-to-text) mapping."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, GenerationMixin

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, GenerationMixin):
            return cls
    if trust_remote_code or not is_composite(config):
        return AutoModelForCausalLM
    return AutoModelForImageTextToText


def text_decoder(model: Any) -> Any:
    """The module holding the decoder layers, embedding and final norm (inside a multimodal wrapper, its language
    model's), whatever it names them (`embed_tokens`/`norm`, Nemotron-H's `embeddings`/`norm_f`)."""
    decoder = model.get_decoder()
    if not hasattr(decoder, "layers"):  # a wrapper's language model that is itself a causal LM (Llama-4)
        decoder = next(
            (m for m in decoder.modules() if hasattr(m, "layers") and decoder_embedding(m) is not None), decoder
        )
    if not hasattr(decoder, "layers") or decoder_embedding(decoder) is None or final_norm(decoder) is None:
        raise UserError(
            f"{type(model).__name__}: its decoder {type(decoder).__name__} has no `layers`, input embedding and "
            "final norm; only decoder-only transformers models (or a multimodal model's text decoder) are supported"
        )
    return decoder


def decoder_embedding(decoder: Any) -> Any:
    """The text decoder's input embedding module, as the decoder itself names it (None: it has none)."""
    try:
        return decoder.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None


def final_norm(decoder: Any) -> Any:
    """The text decoder's final norm: `norm` where it has one, else its last direct child that is a norm module
    (Nemotron-H's `norm_f`), registered after its layers as the forward applies it."""
    norm = getattr(decoder, "norm", None)
    if norm is not None:
        return norm
    return next((m for m in reversed(list(decoder.children())) if "norm" in type(m).__name__.lower()), None)


def activation(config: Any) -> str:
    """The text decoder's MLP activation, under whichever name its config class keeps it."""
    text = text_config(config)
    for key in ACTIVATION_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, str):
            return value
    return "silu"


def full_attention_rope(config: Any) -> dict[str, Any] | None:
    """The RoPE of the target's full-attention layers, for a draft layer that attends over the whole context:
    configs with one RoPE per layer type (Gemma-3) give their full-attention one; M-RoPE's sections (Qwen2.5-VL)
    are dropped, a draft's positions being 1-D."""
    rope = getattr(text_config(config), "rope_parameters", None)
    if not isinstance(rope, dict):
        return None
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):
        rope = rope["full_attention"]
    return {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}


def draft_layer_values(config: Any) -> dict[str, Any]:
    """The values a draft's decoder layer shaped like the target's takes (width, heads, MLP width, norm epsilon,
    RoPE of its full-attention layers, activation, vocabulary), whatever the target's family calls them."""
    text = text_config(config)
    heads = text.num_attention_heads
    return {
        "hidden_size": text.hidden_size,
        "intermediate_size": getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "rms_norm_eps": getattr(text, "rms_norm_eps", None) or getattr(text, "layer_norm_eps", None) or 1e-6,
        "max_position_embeddings": text.max_position_embeddings,
        "rope_parameters": full_attention_rope(config),
        "vocab_size": text.vocab_size,
        "hidden_act": activation(config),
    }


def layer_types(config: Any) -> list[str]:
    """Each decoder layer's kind (`full_attention`, `sliding_attention`, `linear_attention`, ...), as its config
    lists them; full attention for every layer of a config that lists none."""
    text = text_config(config)
    kinds = getattr(text, "layer_types", None)
    if isinstance(kinds, list) and kinds:
        return [str(k) for k in kinds]
    window = getattr(text, "sliding_window", None)
    kind = "sliding_attention" if isinstance(window, int) and window > 0 else "full_attention"
    return [kind] * int(text.num_hidden_layers)


def recurrent_layers(config: Any) -> list[str]:
    """The kinds of the target's layers that keep a recurrent state (hybrid linear attention: Qwen3-Next,
    Qwen3.5), which a speculative decoder must snapshot to reject drafts."""
    return sorted({kind for kind in layer_types(config) if kind in RECURRENT_LAYERS})


def pads_exactly(config: Any) -> bool:
    """Whether a right-padded batch gives each row the states the target computes on it alone: true for causal
    attention (full, windowed, chunked) and a recurrence run left to right, whose rows never see the padding after
    them. A layer that selects its keys (DeepSeek-V3.2's indexer: the top-k of scores, many tied) picks among a
    row's columns, so the padded width changes which tied keys it keeps; such a target runs unpadded."""
    return all(kind in PAD_EXACT_LAYERS for kind in layer_types(config))


def uses_mla(config: Any) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi): keys and values compressed through a low-rank cache."""
    return bool(getattr(text_config(config), "kv_lora_rank", None))


def nextn_layer_prefixes(config: Any) -> tuple[str, ...]:
    """Where a checkpoint keeps the target's own MTP layers (DeepSeek-V3, GLM-4.5: `model.layers.{n + i}` for the
    `num_nextn_predict_layers` after its n decoder layers), which transformers' model does not build."""
    text = config.get_text_config()
    n, extra = text.num_hidden_layers, getattr(text, "num_nextn_predict_layers", 0) or 0
    return tuple(f"model.layers.{n + i}." for i in range(extra))
