"""The llama.cpp format of a DSpark draft: `draft.gguf`, which `llama-server --spec-type draft-dspark` loads next to
the target's GGUF. llama.cpp's converter reads our speculators files as they are (its DSpark class): the `dflash`
architecture with `markov_w1`, `markov_w2`, `conf_proj`, `sample_from_anchor` and `has_confidence_head`. It runs the
vanilla Markov head only (the recipe refuses the others for llama.cpp)."""

from __future__ import annotations

from typing import Any, ClassVar

from speculators_train.families.block.gguf import GGUFFormat as DFlashGGUF
from speculators_train.families.dspark.formats import DSparkFormat


class GGUFFormat(DFlashGGUF, DSparkFormat):
    engines = "llama.cpp (`llama-server --spec-type draft-dspark`)"
    llamacpp_spec_type = "draft-dspark"
    converter_labels: ClassVar[dict[str, Any]] = {}  # the converter's DSpark class reads these files as written
