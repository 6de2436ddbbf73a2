"""The llama.cpp format of a DFlash draft: `draft.gguf`, which `llama-server --spec-type draft-dflash` loads next to
the target's GGUF.

    <out>/draft.gguf    arch `dflash`: the draft layers, fc, norms, lm_head, d2t as absolute target ids, the block
                        size, the target layers (our aux ids) and the mask token (llama.cpp's own converter writes
                        it from the speculators files beside it)
    <out>/config.json, model.safetensors, tokenizer files: the speculators format it was converted from, which
                        every stage here reads back

llama.cpp's converter reads a speculators-layout DFlash block only through its DSpark class (`DSparkSpeculator`:
it flattens `transformer_layer_config`, turns `aux_hidden_state_layer_ids` into its target layers and writes d2t
as target ids); its DFlash class reads z-lab's flat layout, with no d2t. A DSpark without a Markov head and with
`sample_from_anchor: false` is DFlash: the bonus token anchors a block of mask slots, read bidirectionally. So the
converter is handed these files under that name (a folder of its own, the weights linked, not copied) and writes
the same `dflash` architecture either way.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, ClassVar

from speculators_train.engines.llamacpp.converter import OUTTYPES, convert
from speculators_train.families.block.formats import DFlashFormat
from speculators_train.families.format_common import GGUFDraft

# What llama.cpp's converter needs to read this draft as the DFlash case of its DSpark class.
AS_DSPARK = {
    "architectures": ["DSparkSpeculator"],
    "speculators_model_type": "dspark",
    "sample_from_anchor": False,
    "markov_rank": 0,
    "enable_confidence_head": False,
    "confidence_head_with_markov": False,
}


class GGUFFormat(GGUFDraft, DFlashFormat):
    engines = "llama.cpp (`llama-server --spec-type draft-dflash`)"
    draft_architecture = "dflash"
    llamacpp_spec_type = "draft-dflash"
    converter_labels: ClassVar[dict[str, Any]] = AS_DSPARK  # config keys the converter's copy overrides

    def converter_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The config.json the converter's copy of the export holds."""
        return {**config, **self.converter_labels}

    def finish(self, out: Path, target_dir: Path, dtype: str) -> None:
        config = json.loads((out / "config.json").read_text())
        with tempfile.TemporaryDirectory(dir=out, prefix=".converter-") as tmp:
            source = Path(tmp) / out.name  # the converter names the model after its folder
            source.mkdir()
            (source / "config.json").write_text(json.dumps(self.converter_config(config), indent=2))
            os.link(out / "model.safetensors", source / "model.safetensors")
            convert(source, out / self.draft_file, OUTTYPES[dtype], target_dir=target_dir)
