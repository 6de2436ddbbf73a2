"""The llama.cpp format of an EAGLE-3 draft: `draft.gguf`, which `llama-server` loads next to the target's GGUF.

    <out>/draft.gguf    arch `eagle3`: the draft layer, fc, norm, lm_head, d2t as absolute target ids (llama.cpp's
                        own converter writes it from the speculators files beside it)
    <out>/config.json, model.safetensors, tokenizer files: the speculators format it was converted from, which
                        every stage here reads back

What llama.cpp does with it (SPEC.md section 10), and why the writer refuses some drafts:
- it reads the aux layer ids from the top-level `eagle_aux_hidden_state_layer_ids`, as vLLM counts them, and
  needs exactly 3 (its fc takes 3 target states);
- `--spec-type draft-eagle3` must be passed: the type is not detected from the file (`engines.llamacpp.server`);
- it runs `norm_before_fc` (the converter maps `input_norm` and writes `eagle3.norm_before_fc`) but ignores
  `norm_output`: it always feeds the pre-norm output back, so a norm_output draft is refused;
- it drafts the argmax, chain only.
"""

from __future__ import annotations

from pathlib import Path

from speculators_train.engines.llamacpp.converter import OUTTYPES, convert
from speculators_train.families.eagle.model import Eagle3Draft
from speculators_train.families.eagle3.formats import SpeculatorsFormat
from speculators_train.families.format_common import GGUFDraft


class GGUFFormat(GGUFDraft, SpeculatorsFormat):
    engines = "llama.cpp (`llama-server --spec-type draft-eagle3`)"
    draft_architecture = "eagle3"
    llamacpp_spec_type = "draft-eagle3"

    def unsupported(self, draft: Eagle3Draft) -> list[str]:
        ids = draft.config.aux_layer_ids
        out = []
        if len(ids) != 3:
            out.append(f"llama.cpp's EAGLE-3 fc takes exactly 3 target states; this draft reads {len(ids)} ({ids})")
        if draft.config.norm_output:
            out.append(
                "norm_output is true, but llama.cpp ignores it and feeds the pre-norm output back between draft "
                "steps (it would draft wrong tokens); export --format speculators for vLLM, or train with "
                "draft.norm_output: false"
            )
        return out

    def finish(self, out: Path, target_dir: Path, dtype: str) -> None:
        convert(out, out / self.draft_file, OUTTYPES[dtype], target_dir=target_dir)
