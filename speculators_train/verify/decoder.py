"""Speculative decoding with the real target: the draft proposes, the target verifies in one forward.

Bookkeeping (one sequence; L tokens so far, the last one "pending"):

    target KV cache   x_0 .. x_{L-2}          (the pending token x_{L-1} is the next verify input)
    draft KV cache    pairs (x_{j+1}, g_j) for j = 0 .. L-2

A verify step feeds [x_{L-1}, d_1 .. d_K] (chain: causal; tree: each node sees its ancestors, at position
L-1+depth), accepts a prefix/path and one more token from the target (correction or bonus), then keeps only the
accepted entries of the target cache (chain: crop; tree: compact the accepted path) and commits the new pairs to
the draft, which crops away its own speculative entries first.

The target's cache keeps every key of every layer, sliding-window and chunked-attention layers too (a sliding
cache keeps only the last window, so a rollback by position would lose keys a later query needs); the window or
chunk is applied by the attention mask instead: transformers builds it from the layer types for a chain, and a
tree's mask is built here for each layer type.

A recurrent (linear-attention) layer (Qwen3-Next, Qwen3.5) keeps one state, not one entry per token, so cropping
cannot roll it back. Its states are kept before each verify forward; when a draft token is rejected, the
attention layers are cropped to that point, the states restored, and the accepted tokens run again (one more
forward of at most K + 1 tokens, only on a rejection). vLLM's hybrid runners keep a state per position instead,
which needs kernels that write every intermediate state: transformers' write the last one only. Trees, whose nodes
branch from one state, are refused for such a target.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import (
    CacheLayerMixin,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
)

from speculators_train.architectures import (
    CAUSAL_ATTENTION_LAYERS,
    MIXERLESS_LAYERS,
    layer_types,
    recurrent_layers,
    text_config,
)
from speculators_train.errors import UserError
from speculators_train.proposal import DraftTree, Proposer, Sampling, TreeSpec
from speculators_train.target import NO_STATES, StateSpec, Target
from speculators_train.verify import sampling as rules


@dataclass
class Generation:
    tokens: list[int]  # generated tokens (the prompt excluded), cut at EOS (kept) or the limit
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per verify step
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _timed(result: Generation, phase: str, device: torch.device) -> Iterator[None]:
    """Add the block's wall time (device work included) to `result.<phase>`."""
    start = time.perf_counter()
    yield
    _sync(device)
    setattr(result, phase, getattr(result, phase) + time.perf_counter() - start)


def _cut(new: list[int], have: int, max_new_tokens: int, eos: set[int]) -> tuple[list[int], bool]:
    """The tokens of `new` that may be emitted after `have` tokens, and whether generation is over."""
    out = []
    for token in new:
        out.append(token)
        if token in eos or have + len(out) >= max_new_tokens:
            return out, True
    return out, False


LOOP_LAYERS = CAUSAL_ATTENTION_LAYERS | MIXERLESS_LAYERS


def refuse_unlooped(config, name: str, tree: bool) -> None:
    """Layer types the loop cannot verify (a selection of keys, DeepSeek-V3.2's indexer, has no cache or mask
    here), and trees on a recurrent target: a tree's nodes branch from one recurrent state, which the loop keeps one
    of, so such a target verifies chains."""
    if unknown := sorted(set(layer_types(config)) - LOOP_LAYERS - set(recurrent_layers(config))):
        raise UserError(
            f"target {name}: layer type {unknown[0]!r} is not one the verify loop can mask (train and export run; "
            "verify with --engine vllm where vLLM serves it)"
        )
    if tree and (kinds := recurrent_layers(config)):
        raise UserError(
            f"target {name}: its {', '.join(kinds)} layers keep one recurrent state, which a tree's branches cannot "
            "share; verify it with eval.mode: chain"
        )


class TargetRunner:
    """The target with a KV cache: forwards that also return the states a draft reads."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.recurrent = bool(recurrent_layers(target.config))
        self.model = target.model
        self.device = next(self.model.parameters()).device
        text = text_config(target.config)
        kinds = layer_types(target.config)
        # What limits each layer type's view of earlier keys, for the masks of tree verification.
        self.windows = {
            "sliding_attention": ("window", getattr(text, "sliding_window", None)),
            "chunked_attention": ("chunk", getattr(text, "attention_chunk_size", None)),
        }
        self.kinds = sorted(set(kinds))
        refuse_unlooped(target.config, repr(target.name_or_path), tree=False)
        self.cache = self._new_cache()

    def reset(self) -> None:
        self.cache = self._new_cache()

    def _new_cache(self) -> DynamicCache:
        """Every attention layer a plain full cache, whatever its window (see the module docstring); a recurrent
        layer's states live in the linear-attention layers only a cache built from the config has."""
        cache = DynamicCache(config=self.target.config) if self.recurrent else DynamicCache()
        cache.layers = [DynamicLayer() if isinstance(x, DynamicSlidingWindowLayer) else x for x in cache.layers]
        return cache

    @torch.inference_mode()
    def snapshot(self) -> list[tuple[dict, dict]] | None:
        """The recurrent layers' conv and recurrent states, to restore on a rejection (None: no such layers)."""
        if not self.recurrent:
            return None
        return [
            ({i: t.clone() for i, t in layer.conv_states.items() if t is not None},
             {i: t.clone() for i, t in layer.recurrent_states.items() if t is not None})
            if isinstance(layer, LinearAttentionCacheLayerMixin) else ({}, {})
            for layer in self.cache.layers
        ]  # fmt: skip

    @torch.inference_mode()
    def rerun(self, length: int, snapshot: list[tuple[dict, dict]], tokens: list[int]) -> None:
        """Back to the cache of `length` tokens whose recurrent states are `snapshot`, then `tokens` run on it."""
        drop = self.length - length
        for layer, (conv, recurrent) in zip(self.cache.layers, snapshot, strict=True):
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                layer.conv_states.update({i: t.clone() for i, t in conv.items()})
                for i, t in recurrent.items():
                    layer.recurrent_states[i].copy_(t)
            if isinstance(layer, CacheLayerMixin) and drop:
                layer.crop(-drop)
        self.forward(tokens)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def _tree_mask(self, start: int, tree: DraftTree) -> torch.Tensor | dict[str, torch.Tensor]:
        """The additive mask of a tree verify forward: each node sees the cache, the root and its ancestors (at
        position start + depth), within each layer type's window or chunk. One mask per layer type when the target
        mixes them (transformers takes a dict of them), else the one mask."""
        t = len(tree.tokens) + 1
        allowed = torch.zeros(t, start + t, dtype=torch.bool, device=self.device)
        allowed[:, : start + 1] = True  # the cache and the root
        for node, parent in enumerate(tree.parents, start=1):
            allowed[node] = allowed[parent + 1] if parent >= 0 else allowed[0]
            allowed[node, start + node] = True
        depth = torch.tensor([0, *tree.depths], device=self.device)
        query_pos = start + depth
        key_pos = torch.cat([torch.arange(start, device=self.device), query_pos])
        dtype = self.target.dtype
        masks = {}
        for kind in self.kinds:
            seen = allowed
            if kind in self.windows:
                rule, size = self.windows[kind]
                if rule == "window":
                    seen = allowed & (query_pos[:, None] - key_pos[None, :] < size)
                else:
                    seen = allowed & (query_pos[:, None] // size == key_pos[None, :] // size)
            mask = torch.zeros(1, 1, t, start + t, dtype=dtype, device=self.device)
            masks[kind] = mask.masked_fill_(~seen, torch.finfo(dtype).min)
        return masks if len(masks) > 1 else next(iter(masks.values()))

    @torch.inference_mode()
    def forward(
        self, tokens: list[int], tree: DraftTree | None = None, states: StateSpec = NO_STATES
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [T, V] (float32) and the states a proposer reads (`states`, gathered as `Target.gathered` does,
        [T, ...]; None when it reads none) for `tokens` appended after the cache. With `tree`, tokens[0] is the
        root and tokens[1:] are its nodes."""
        start = self.length
        ids = torch.tensor([tokens], device=self.device)
        mask = None
        if tree is None:
            positions = torch.arange(start, start + len(tokens), device=self.device)
        else:
            positions = start + torch.tensor([0, *tree.depths], device=self.device)
            mask = self._tree_mask(start, tree)
        kwargs = {"past_key_values": self.cache, "position_ids": positions[None], "use_cache": True}
        if states == NO_STATES:
            return self.model(input_ids=ids, attention_mask=mask, **kwargs).logits[0].float(), None
        with self.target.capture(states) as store:
            logits = self.model(input_ids=ids, attention_mask=mask, **kwargs).logits
        return logits[0].float(), Target.gathered(store, states)[0]

    def keep(self, length: int, extra: list[int]) -> None:
        """Keep the first `length` cache entries plus the entries at `extra` (absolute indices, ascending)."""
        if not extra and length == self.length:
            return
        if extra == list(range(length, length + len(extra))):  # a chain: drop the rejected tail
            if self.length > length + len(extra):
                self.cache.crop(length + len(extra) - self.length)
            return
        index = torch.tensor([*range(length), *extra], device=self.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)


def verify_width(k: int, tree: TreeSpec | None) -> int:
    """Tokens per full verify forward (the pending token + the drafts): the row count worth packing weights for."""
    if tree is None:
        return k + 1
    return 1 + (len(tree.paths) if tree.paths is not None else tree.budget)


class SpeculativeDecoder:
    def __init__(
        self,
        target: Target,
        proposer: Proposer,
        sampling: Sampling,
        num_speculative_tokens: int = 5,
        tree: TreeSpec | None = None,
    ) -> None:
        refuse_unlooped(target.config, repr(target.name_or_path), tree is not None)
        self.runner = TargetRunner(target)
        self.proposer = proposer
        self.sampling = sampling
        self.k = num_speculative_tokens
        self.tree = tree

    def generate(
        self, prompt: list[int], max_new_tokens: int, eos: set[int], generator: torch.Generator | None = None
    ) -> Generation:
        if len(prompt) < 2:
            raise ValueError("a prompt needs at least 2 tokens (the template adds more)")
        runner, device = self.runner, self.runner.device
        result = Generation(tokens=[])
        _sync(device)
        started = time.perf_counter()
        runner.reset()
        self.proposer.reset(prompt[0])
        with _timed(result, "prefill_seconds", device):
            _, states = runner.forward(prompt[:-1], states=self.proposer.states)
        with _timed(result, "draft_seconds", device):
            self.proposer.extend(prompt[1:], states)
        pending, done = prompt[-1], max_new_tokens <= 0
        while not done:
            with _timed(result, "draft_seconds", device):
                if self.tree is None:
                    drafts, q = self.proposer.propose_chain(self.k, self.sampling, generator)
                    tree = None
                else:
                    tree = self.proposer.propose_tree(self.tree)
                    drafts, q = tree.tokens, None
            before, snapshot = runner.length, runner.snapshot()
            with _timed(result, "verify_seconds", device):
                logits, states = runner.forward([pending, *drafts], tree, self.proposer.states)
            path, token = self._accept(drafts, q, logits, tree, generator)
            result.accepted.append(len(path))
            new = [drafts[node] for node in path] + [token]
            emitted, done = _cut(new, len(result.tokens), max_new_tokens, eos)
            result.tokens += emitted
            if done:
                break
            if snapshot is not None and len(path) < len(drafts):
                with _timed(result, "verify_seconds", device):
                    runner.rerun(before, snapshot, [pending, *new[:-1]])
            else:
                runner.keep(before + 1, [before + 1 + node for node in path])
            kept = None if states is None else states[[0, *(1 + node for node in path)]]
            with _timed(result, "draft_seconds", device):
                self.proposer.extend(new, kept)
            pending = token
        result.seconds = time.perf_counter() - started
        return result

    def _accept(
        self,
        drafts: list[int],
        q: torch.Tensor | None,
        logits: torch.Tensor,
        tree: DraftTree | None,
        generator: torch.Generator | None,
    ) -> tuple[list[int], int]:
        """(accepted draft indices in order, the target's token after them)."""
        greedy = self.sampling.greedy
        if tree is None:
            if greedy:
                a, token = rules.accept_chain_greedy(drafts, logits)
            else:
                p = rules.target_probs(logits, self.sampling)
                a, token = rules.accept_chain_sampled(drafts, None if q is None else q.to(p.device), p, generator)
            return list(range(a)), token
        path: list[int] = []
        node = -1
        while True:
            children = tree.children.get(node, [])
            row = logits[node + 1]
            if greedy:
                child, token = rules.accept_children_greedy(children, tree.tokens, row)
            else:
                p = rules.target_probs(row, self.sampling)
                child, token = rules.accept_children_sampled(children, tree.tokens, p, generator)
            if child is None:
                return path, token
            path.append(child)
            node = child


@torch.inference_mode()
def decode_plain(
    target: Target,
    prompt: list[int],
    max_new_tokens: int,
    eos: set[int],
    sampling: Sampling,
    generator: torch.Generator | None = None,
    runner: TargetRunner | None = None,
) -> Generation:
    """Target-only decoding with the same KV cache and the same prefill split: the baseline."""
    runner = runner or TargetRunner(target)
    _sync(runner.device)
    started = time.perf_counter()
    runner.reset()
    result = Generation(tokens=[])
    if max_new_tokens > 0:
        with _timed(result, "prefill_seconds", runner.device):
            runner.forward(prompt[:-1])
        pending, done = prompt[-1], False
        while not done:
            logits, _ = runner.forward([pending])
            if sampling.greedy:
                token = int(logits[-1].argmax())
            else:
                token = rules.sample(rules.target_probs(logits[-1], sampling), generator)
            emitted, done = _cut([token], len(result.tokens), max_new_tokens, eos)
            result.tokens += emitted
            pending = token
    _sync(runner.device)
    result.seconds = time.perf_counter() - started
    return result
