"""What a draft family is: its recipe section, and one object that every stage asks for family-specific work.

    settings.py   Settings: the recipe's `draft:` section for this family (a pydantic Section tagged by `family`),
                  with the rules a recipe is checked against when it loads
    family.py     FAMILY: build / load / save a draft, the target states it reads, its objective (loss and metric
                  sums), its proposer for the verify loop, and its export formats (writer and reader of each)

Stages (trainer, OSD, verify, export, CLI, eval scripts) hold a `Family` and a draft, and never test which
family they have. This module imports no torch, so loading a recipe stays cheap.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from speculators_train.errors import UserError
from speculators_train.schema import Section

if TYPE_CHECKING:
    import torch
    from torch import nn

    from speculators_train.eval_config import EvalConfig, TreeConfig
    from speculators_train.families.objective import Objective
    from speculators_train.head import TargetHead
    from speculators_train.proposal import Proposer, TreeSpec
    from speculators_train.target import StateSpec, Target


# The per-position losses a draft trains with and OSD distils with (`families/divergence.py` computes them).
Divergence = Literal["ce", "forward_kl", "reverse_kl", "jsd", "tvd", "lk", "lk_hybrid"]

# The target states a family trains on, which is what `generate` stores for its recipes: the recipe's aux layers
# and the final (pre-norm) state, the final state alone, or no state (tokens and loss mask only).
TargetStates = Literal["aux+final", "final", "none"]
STATE_LEVELS: tuple[TargetStates, ...] = ("none", "final", "aux+final")  # each holds what the ones before hold


@dataclass(frozen=True)
class DraftStart:
    """What a fresh draft of any family is built from: the target's transformers config and its local folder (the
    weights and tokenizer a draft that copies the target's own layers reads), its head weights (`load_head_weights`:
    embed, norm, lm_head), token counts over the training data (a draft vocabulary's choice) and the aux states the
    stored data holds (what a draft reading aux states reads)."""

    target_config: Any
    target_dir: Path
    head: dict[str, torch.Tensor]
    token_freq: torch.Tensor
    aux_layer_ids: list[int]


@dataclass(frozen=True)
class SmallDraft:
    """A small draft of a family that a few seconds fit to one reply of a tiny target, as the test suite builds it
    for the engine tests and the pinned loss curves: its `settings` beside the section's defaults, and the fit's
    `steps` and `learning_rate` where this family's differ (a slow step, a rate that diverges)."""

    settings: dict[str, Any]
    steps: int = 120
    learning_rate: float = 3e-3


class FamilySettings(Section):
    """A family's recipe section (`draft:`); `family` names it, once, in the recipe."""

    family: str

    # Rules a recipe is held to when it loads (not discovered at run time):
    # The export formats this family writes, declared once: export.format value -> "module:Class" of its
    # `ExportFormat` in the family's folder (imported when a stage asks `Family.formats`; the first is the default).
    formats: ClassVar[dict[str, str]]
    # The one of `formats` that vLLM serves as a speculative method (`ExportFormat.vllm_speculative_config`), or
    # None: `eval.engine: vllm` is refused at load, and `verify --engine vllm` exports this format.
    vllm_format: ClassVar[str | None] = "speculators"
    vllm_needs_gpu: ClassVar[bool] = False  # vLLM runs its method in the V2 model runner only (Triton: a GPU build)
    # A draft that is one more layer of the target's own (`method: mtp`): the vLLM MTP classes that read a weight
    # layout its vLLM format writes (`ExportFormat.vllm_mtp_classes` names those of one draft's export). vLLM serves
    # it only on targets it maps to one of them.
    vllm_mtp_classes: ClassVar[tuple[str, ...]] = ()
    tree_shapes: ClassVar[tuple[str, ...]] = ("dynamic",)  # eval.tree.shape values its proposer grows
    fine_tunes: ClassVar[bool] = True  # whether training.init_from may name a draft of this family
    target_states: ClassVar[TargetStates] = "aux+final"  # what its objective reads, and `generate` stores
    # Whether the draft has attention layers of its own kind (a Llama or Qwen3 layer beside any target), not the
    # target's architecture nor none: an engine must then run two kinds of attention over one KV cache.
    own_attention: ClassVar[bool] = False
    predicts_acceptance: ClassVar[bool] = False  # its proposer stops a chain at eval.draft_p_min (a confidence head)
    small: ClassVar[SmallDraft]  # its small draft for tests

    def recipe_problems(self, recipe: Any) -> list[str]:
        """Rules that tie this section to other sections of the loaded `Recipe` (not imported here: the recipe
        imports the families); each problem names the keys."""
        return []

    def target_problems(self, target_config: Any) -> list[str]:
        """Why this section cannot make a draft for a target with this transformers config (read, without weights,
        before a stage does any work); each problem names the key and the reason."""
        return []


class ExportFormat(ABC):
    """One on-disk draft format an engine loads: written by `export`, read back by every stage."""

    name: ClassVar[str]  # the export.format value
    engines: ClassVar[str]  # who loads it, for the card
    # For a format an engine loads as one draft file beside the target's own file (llama-server's `-md` beside the
    # target's GGUF, not a hub id): that file in the export, and its GGUF architecture. The engine's arguments for
    # it are the engine's (`engines.llamacpp.server.draft_args`); `commands` gets the target's GGUF as verifier.
    draft_file: ClassVar[str | None] = None
    draft_architecture: ClassVar[str | None] = None
    # llama-server's `--spec-type` for that file; None where the server detects the type from the file itself
    # (DFlash, DSpark and MTP GGUFs: common/speculative.cpp, `common_speculative_types_from_gguf`).
    llamacpp_spec_type: ClassVar[str | None] = None

    @abstractmethod
    def detect(self, config: dict[str, Any]) -> bool:
        """Whether a directory whose config.json holds `config` is in this format."""

    @abstractmethod
    def read(self, path: Path, config: dict[str, Any], target_num_layers: int) -> tuple[nn.Module, bool]:
        """(the draft, whether its files carried `embed_tokens`)."""

    @abstractmethod
    def write(
        self, draft: nn.Module, dtype: str, verifier: str, architectures: list[str], k: int
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """(config.json, model.safetensors tensors) for `dtype` floats and `k` speculative tokens."""

    def unsupported(self, draft: nn.Module) -> list[str]:
        """Why the engine would run this draft differently from how it was trained (empty when it would not)."""
        return []

    def finish(self, out: Path, target_dir: Path, dtype: str) -> None:
        """Add the engine's own files to the written export at `out` (config.json, model.safetensors and the
        tokenizer are there; `target_dir` is the target as an HF directory), for engines that read another format."""
        return None

    def sglang_reading(
        self, draft: nn.Module, config: dict[str, Any], target_num_layers: int
    ) -> list[tuple[str, Any, Any]] | None:
        """(setting, trained, what SGLang will use) for each setting SGLang's loader takes from `config` (an
        export's config.json) otherwise than `draft` was trained, by SGLang's own rules (it does not run here);
        None where SGLang does not load this format."""
        return None

    def vllm_mtp_classes(self, draft: nn.Module) -> tuple[str, ...] | None:
        """The vLLM MTP classes that read this export of `draft` (None: the family's `vllm_mtp_classes`)."""
        return None

    def vllm_speculative_config(self, out: Path, k: int) -> dict[str, Any] | None:
        """The `speculative_config` with which vLLM serves the export at `out` at `k` draft tokens per step, as
        `vllm serve --speculative-config` and `LLM(speculative_config=...)` take it; None: vLLM does not load
        this format."""
        return None

    @abstractmethod
    def commands(self, out: Path, verifier: str, ev: EvalConfig, k: int) -> list[str]:
        """The engine command lines that serve the export at `out`."""


class Family(ABC):
    name: ClassVar[str]
    settings: ClassVar[type[FamilySettings]]  # its recipe section
    title: ClassVar[str]  # "EAGLE-3 draft": how cards and reports name a draft of this family
    step_label: ClassVar[str]  # what one row of per-step metrics is: a TTT step, a head
    draft_type: ClassVar[type]  # the draft module, built from one `config_type` argument
    config_type: ClassVar[type]  # the draft's config: a dataclass whose `to_dict()` is saved as JSON
    # Its reader of a saved config (a staticmethod): `config_type` from a file's values, each checked (a ValueError
    # names the key).
    config_reader: ClassVar[Callable[[dict[str, Any]], Any]]
    proposer_type: ClassVar[type]  # the verify loop's proposer, built by `proposer`
    not_saved: ClassVar[tuple[str, ...]] = ()  # frozen weights restored from the target, never checkpointed

    @cached_property
    def formats(self) -> dict[str, ExportFormat]:
        """The export formats its settings declare, by name (the first is the default)."""
        package = type(self).__module__.rsplit(".", 1)[0]
        out = {}
        for name, where in self.settings.formats.items():
            module, cls = where.split(":")
            out[name] = getattr(import_module(f"{package}.{module}"), cls)()
        return out

    # -- building, loading, saving ------------------------------------------------------------------------------
    def config_from_dict(self, saved: dict[str, Any]) -> Any:
        """The draft's config from its saved `draft_config.json` (someone else's file, maybe), every value typed and
        in range before anything is built from it: a ValueError names the key when one is not."""
        return self.config_reader(saved)

    def build(self, config: Any) -> nn.Module:
        """An untrained draft of this shape (weights to be loaded)."""
        return self.draft_type(config)

    @abstractmethod
    def new_draft(self, settings: FamilySettings, start: DraftStart) -> nn.Module:
        """A fresh draft to train from `start`: its vocabulary from the token counts, its starting weights from the
        target's head (or layers), reading the stored aux states where it reads aux states."""

    def states(self, config: Any) -> StateSpec:
        """The target states a draft of this config reads at inference: the aux states its config names where its
        section trains on aux and final states (the final one only gives the target's distribution there), the
        final state where it trains on that alone, else none."""
        from speculators_train.target import NO_STATES, StateSpec  # torch: not imported when only a recipe is loaded

        level = self.settings.target_states
        if level == "aux+final":
            return StateSpec(tuple(config.aux_layer_ids))
        return StateSpec(final=True) if level == "final" else NO_STATES

    @abstractmethod
    def attach_target(self, draft: nn.Module, embed_weight: torch.Tensor, has_embedding: bool) -> None:
        """Give a loaded draft what it takes from the target (its embedding, unless its files carried one)."""

    def place(self, draft: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """The draft on the target's device and dtype, in eval mode, for decoding."""
        return draft.to(device=device, dtype=dtype).eval()

    # -- training -----------------------------------------------------------------------------------------------
    @abstractmethod
    def objective(
        self,
        draft: nn.Module,
        head: TargetHead,
        settings: FamilySettings,
        depth: int | None = None,
        divergence: str | None = None,
    ) -> Objective:
        """Draft + frozen target head as one module: `forward(batch) -> (loss, metric sums)`. `depth` scores that
        many draft steps instead of the settings' (where the family unrolls); `divergence` distils the target's
        distribution with it instead of the settings' loss (online distillation)."""

    # -- verify loop ------------------------------------------------------------------------------------------------
    def proposer(self, draft: nn.Module, target: Target) -> Proposer:
        """The draft as a proposer for the verify loop, reading the states `states` names; one that reads the
        target's last state also takes the target's final norm, since that state is recorded before the norm."""
        states = self.states(draft.config)
        if states.final:
            return self.proposer_type(draft, target.final_norm, states)
        return self.proposer_type(draft, states)

    def max_draft_tokens(self, draft: nn.Module) -> int | None:
        """The most tokens this draft can propose per step (None: no limit)."""
        return None

    def draft_tokens(self, draft: nn.Module, k: int) -> int:
        """How many of `k` asked draft tokens this draft proposes per step."""
        cap = self.max_draft_tokens(draft)
        return k if cap is None else min(k, cap)

    def tree(self, draft: nn.Module, tree: TreeConfig, held_out: dict[str, Any]) -> TreeSpec:
        """The verify loop's tree for `eval.tree` (shapes other than dynamic are the family's own; `held_out`: the
        metrics the draft's checkpoint was saved with, {} for a draft without)."""
        from speculators_train.proposal import TreeSpec  # torch: not imported when only a recipe is loaded

        if tree.shape != "dynamic":
            raise UserError(f"eval.tree.shape {tree.shape!r}: {self.name} drafts grow dynamic trees only")
        return TreeSpec(tree.top_k, self.draft_tokens(draft, tree.depth), tree.budget)

    # -- export -------------------------------------------------------------------------------------------------
    @abstractmethod
    def card_rows(self, draft: nn.Module, fmt: str, k: int) -> list[tuple[str, str]]:
        """The export card's architecture rows."""


@dataclass
class LoadedDraft:
    """A draft read from disk, with what the stages need to know about where it came from."""

    family: Family
    draft: Any  # nn.Module
    path: Path  # the directory actually read (a checkpoints/ dir resolves to its best checkpoint)
    has_embedding: bool  # its files carried `embed_tokens` (engines then keep theirs)
