"""Replace assistant turns with the target's own responses.

A draft learns to predict the *target*, so training on the target's outputs rather than the dataset's
(written by another model) raises acceptance. Turns are regenerated in order, each one conditioned on
the already-regenerated earlier turns, batched across conversations.
"""

from __future__ import annotations

import torch

from speculators_train.data.conversations import Conversation
from speculators_train.recipe import RegenerateConfig


@torch.inference_mode()
def regenerate(
    conversations: list[Conversation], model, tokenizer, cfg: RegenerateConfig, max_length: int, seed: int
) -> list[Conversation]:
    """Same conversations with every assistant turn produced by the target (seeded, so reruns match)."""
    generator_seed = torch.Generator().manual_seed(seed)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator_seed)))
    messages = [_first_turns(_without_leading_replies(list(c.messages)), cfg.max_turns) for c in conversations]
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if tokenizer.pad_token is None:  # e.g. Llama-3 tokenizers ship without one; batching needs it
        tokenizer.pad_token = tokenizer.eos_token
    for turn in range(max((len(m) for m in messages), default=0)):
        todo = [i for i, m in enumerate(messages) if turn < len(m) and m[turn]["role"] == "assistant"]
        prompts = {
            i: tokenizer.apply_chat_template(messages[i][:turn], tokenize=False, add_generation_prompt=True)
            for i in todo
        }
        lengths = {i: len(tokenizer(prompts[i], add_special_tokens=False)["input_ids"]) for i in todo}
        for i in todo:
            if lengths[i] >= max_length:  # past max_length the rest is truncated away anyway: end it here
                messages[i] = messages[i][:turn]
        # Similar lengths batch together (little padding), and nobody generates what truncation would drop.
        fits = sorted((i for i in todo if lengths[i] < max_length), key=lambda i: (lengths[i], i))
        for start in range(0, len(fits), cfg.batch_size):
            batch = fits[start : start + cfg.batch_size]
            enc = tokenizer(
                [prompts[i] for i in batch],
                return_tensors="pt",
                padding=True,
                padding_side="left",
                add_special_tokens=False,
            )
            out = model.generate(
                **enc.to(device),
                max_new_tokens=min(cfg.max_new_tokens, max_length - lengths[batch[0]]),
                do_sample=cfg.temperature > 0,
                temperature=cfg.temperature if cfg.temperature > 0 else None,
                top_p=cfg.top_p if cfg.temperature > 0 else None,
                top_k=None,
                pad_token_id=pad_id,
            )
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            for i, text in zip(batch, texts, strict=True):
                messages[i] = [
                    *messages[i][:turn],
                    {"role": "assistant", "content": text.strip()},
                    *messages[i][turn + 1 :],
                ]
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
