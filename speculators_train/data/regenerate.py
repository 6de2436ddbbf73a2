"""Replace assistant turns with the target's own responses.

A draft learns to predict the *target*, so training on the target's outputs rather than the dataset's
(written by another model) raises acceptance. Turns are regenerated in order, each one conditioned on
the already-regenerated earlier turns, batched across conversations.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from speculators_train.data.chat import Chat
from speculators_train.data.config import RegenerateConfig
from speculators_train.data.conversations import Conversation
from speculators_train.errors import UserError
from speculators_train.folders import check_model_folder
from speculators_train.loading import reading

# One turn's requests: (rendered prompt, new-token cap) -> reply texts, in order.
Replies = Callable[[list[tuple[str, int]]], list[str]]

# `data.regenerate.model` loaded once per process: generation calls `replying_model` for every chunk.
_REPLYING: dict[str, Any] = {}


def replying_model(source: str, target_model, tokenizer):
    """The LM `data.regenerate.model` names, on the target's device and dtype, refused unless its tokenizer is the
    target's (its replies are rendered and scored as target ids). Weights are read from safetensors only."""
    if source not in _REPLYING:
        check_replying_tokenizer(source, tokenizer)
        from transformers import AutoModelForCausalLM

        with reading(source, "data.regenerate.model"):
            model = AutoModelForCausalLM.from_pretrained(
                source, dtype=target_model.dtype, use_safetensors=True, trust_remote_code=False
            )
        _REPLYING.clear()
        _REPLYING[source] = model.to(next(target_model.parameters()).device).eval()
    return _REPLYING[source]


def check_replying_tokenizer(source: str, tokenizer) -> None:
    """The gate of every engine's replying model: a folder this toolkit (or vLLM) may load
    (`folders.check_model_folder`), whose tokenizer is the target's."""
    from transformers import AutoTokenizer

    check_model_folder(source, "data.regenerate.model")
    with reading(source, "data.regenerate.model"):
        theirs = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise UserError(f"data.regenerate.model {source!r}: its tokenizer is not the target's")


@torch.inference_mode()
def regenerate(
    conversations: list[Conversation], model, chat: Chat, cfg: RegenerateConfig, max_length: int, seed: int
) -> list[Conversation]:
    """Same conversations with every assistant turn produced by the target in `transformers` (seeded, so reruns
    match), batched `cfg.batch_size` prompts of similar length at a time."""
    generator_seed = torch.Generator().manual_seed(seed)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator_seed)))
    device = next(model.parameters()).device
    tokenizer = chat.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if tokenizer.pad_token is None:  # e.g. Llama-3 tokenizers ship without one; batching needs it
        tokenizer.pad_token = tokenizer.eos_token

    def replies(requests: list[tuple[str, int]]) -> list[str]:
        texts: list[str] = []
        for start in range(0, len(requests), cfg.batch_size):
            batch = requests[start : start + cfg.batch_size]
            enc = tokenizer(
                [prompt for prompt, _ in batch],
                return_tensors="pt",
                padding=True,
                padding_side="left",
                add_special_tokens=False,
            )
            out = model.generate(
                **enc.to(device),
                max_new_tokens=max(cap for _, cap in batch),
                do_sample=cfg.temperature > 0,
                temperature=cfg.temperature if cfg.temperature > 0 else None,
                top_p=cfg.top_p if cfg.temperature > 0 else None,
                top_k=None,
                pad_token_id=pad_id,
            )
            texts += _decoded(tokenizer, out[:, enc["input_ids"].shape[1] :].tolist(), pad_id)
        return texts

    return _regenerate(conversations, chat, cfg, max_length, replies)


def regenerate_llamacpp(
    conversations: list[Conversation],
    chat: Chat,
    cfg: RegenerateConfig,
    max_length: int,
    seed: int,
    gguf: Path,
    server_cpu: list[float] | None = None,
) -> list[Conversation]:
    """Same conversations with every assistant turn produced by llama.cpp serving the target's GGUF file (the one
    an engine serves), `cfg.batch_size` requests decoding at once in the server's parallel slots. Prompts are
    rendered by the same chat template and sent as token ids. The server's CPU seconds are appended to
    `server_cpu` (benchmarks)."""
    from speculators_train.engines.llamacpp.server import Server

    slots = cfg.batch_size
    tokenizer = chat.tokenizer
    log = Path(tempfile.gettempdir()) / f"speculators_train-regenerate-{os.getpid()}.log"
    with Server(gguf, [], log, ctx=slots * max_length, slots=slots) as server:

        def reply(index: int, request: tuple[str, int]) -> str:
            prompt, cap = request
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            tokens = server.generate(ids, cap, cfg.temperature, cfg.top_p, seed + index)
            return _decoded(tokenizer, [tokens])[0]

        def replies(requests: list[tuple[str, int]]) -> list[str]:
            with ThreadPoolExecutor(slots) as pool:
                return list(pool.map(reply, range(len(requests)), requests))

        out = _regenerate(conversations, chat, cfg, max_length, replies)
        if server_cpu is not None:
            server_cpu.append(server.cpu_seconds())
        return out


def regenerate_vllm(
    conversations: list[Conversation],
    chat: Chat,
    cfg: RegenerateConfig,
    max_length: int,
    seed: int,
    model: Path,
    engine: Any = None,
) -> list[Conversation]:
    """Same conversations with every assistant turn produced by vLLM's offline batch generation on the target's HF
    folder `model`: each turn's requests go in one call (vLLM schedules them together), prompts rendered by the
    same chat template and sent as token ids, request i of a turn sampled with seed `seed + i`. An open
    `engines.vllm.offline.Engine` on that folder may be passed in (`replying_engine`: a stage opens one for all its
    chunks).
    """
    tokenizer = chat.tokenizer

    def replies(requests: list[tuple[str, int]]) -> list[str]:
        ids = [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt, _ in requests]
        caps = [cap for _, cap in requests]
        seeds = [seed + i for i in range(len(requests))]
        done = engine.generate(ids, caps, cfg.temperature, cfg.top_p, seeds).completions
        return _decoded(tokenizer, [c.tokens for c in done])

    if engine is not None:
        return _regenerate(conversations, chat, cfg, max_length, replies)
    with replying_engine(model, max_length, seed) as engine:
        return _regenerate(conversations, chat, cfg, max_length, replies)


def replying_engine(model: Path, max_length: int, seed: int):
    """A vLLM engine on `model` for `regenerate_vllm`, which a stage opens once and passes to every chunk (each
    start costs a minute or more); replies are seeded per request, so they do not depend on which chunk opened it."""
    from speculators_train.engines.vllm.offline import Engine

    # On a GPU, vLLM shares the device with the transformers copy that captures the hidden states.
    share = 0.5 if torch.cuda.is_available() else None
    return Engine(model, max_model_len=max_length, seed=seed, gpu_memory_utilization=share)


def _decoded(tokenizer, sequences: list[list[int]], pad_id: int | None = None) -> list[str]:
    """Generated ids as text with their special tokens (padding dropped): `Chat.as_message` reads the template's
    own markers (a channel header, a think block, the end-of-turn token) out of them."""
    return [tokenizer.decode([t for t in ids if t != pad_id or pad_id is None]) for ids in sequences]


def _regenerate(
    conversations: list[Conversation], chat: Chat, cfg: RegenerateConfig, max_length: int, replies: Replies
) -> list[Conversation]:
    """Turns are regenerated in order, each conditioned on the already-regenerated earlier turns."""
    tokenizer = chat.tokenizer
    messages = [_first_turns(_without_leading_replies(list(c.messages)), cfg.max_turns) for c in conversations]
    for turn in range(max((len(m) for m in messages), default=0)):
        todo = [i for i, m in enumerate(messages) if turn < len(m) and m[turn]["role"] == "assistant"]
        prompts = {i: chat.render(messages[i][:turn], True) for i in todo}
        lengths = {i: len(tokenizer(prompts[i], add_special_tokens=False)["input_ids"]) for i in todo}
        for i in todo:
            if lengths[i] >= max_length:  # past max_length the rest is truncated away anyway: end it here
                messages[i] = messages[i][:turn]
        # Similar lengths batch together (little padding), and nobody generates what truncation would drop.
        fits = sorted((i for i in todo if lengths[i] < max_length), key=lambda i: (lengths[i], i))
        requests = [(prompts[i], min(cfg.max_new_tokens, max_length - lengths[i])) for i in fits]
        for i, text in zip(fits, replies(requests), strict=True):
            reply = chat.as_message(text)
            messages[i] = [*messages[i][:turn], reply, *messages[i][turn + 1 :]]
    # A conversation cut before its first assistant turn is counted as a skip when rendered.
    return [Conversation(c.id, tuple(m), c.origin) for c, m in zip(conversations, messages, strict=True)]


def _without_leading_replies(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Assistant turns before any user turn answer nothing, so there is no prompt to regenerate them from
    (ShareGPT has records that open with the model speaking): drop them."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    return [m for i, m in enumerate(messages) if i >= first_user or m["role"] != "assistant"]


def _first_turns(messages: list[dict[str, str]], max_turns: int | None) -> list[dict[str, str]]:
    """Up to and including the `max_turns`-th assistant turn (all of them if None)."""
    if max_turns is None:
        return messages
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return messages if len(replies) <= max_turns else messages[: replies[max_turns - 1] + 1]
