"""The llama.cpp format of a DFlash2 draft: `draft.gguf`, which `llama-server --spec-type draft-dflash` loads next to
the target's GGUF (its DFlash runtime runs the convolutions and the candidate selector when the file has them).

llama.cpp's converter reads DFlash2 only through its DFlash class, in z-lab's flat layout: the Qwen3 fields at the
top, and the mask token, target layers (our aux ids - 1), block size, convolution and selector options under
`dflash_config`. The converter is handed our files with that config (a folder of its own, the weights linked, not
copied); it maps our tensor names (`layers.N.attention_conv.*`, `candidate_selector.*`) as they are.
"""

from __future__ import annotations

from typing import Any

from speculators_train.families.block.gguf import GGUFFormat as BlockGGUF
from speculators_train.families.dflash2.formats import DFlash2Format
from speculators_train.families.dflash2.model import OPTIONS


class GGUFFormat(BlockGGUF, DFlash2Format):
    engines = "llama.cpp (`llama-server --spec-type draft-dflash`)"

    def converter_config(self, config: dict[str, Any]) -> dict[str, Any]:
        dflash = {
            "mask_token_id": config["mask_token_id"],
            "target_layer_ids": [i - 1 for i in config["aux_hidden_state_layer_ids"]],
            "block_size": config["block_size"],
            "causal": False,
            **{key: config[key] for key in OPTIONS},
        }
        return {**config, **config["transformer_layer_config"], "dflash_config": dflash}
