"""The recipe's `export:` section: the format written, its dtype, and the verifier engines load.

Kept next to the export code that reads it, and apart from it so that loading a recipe imports no torch: the recipe
(`recipe.py`) composes this section and checks `format` against the draft family's formats.
"""

from __future__ import annotations

from pydantic import Field

from speculators_train.schema import DTypeName, Section


class ExportConfig(Section):
    format: str | None = Field(
        None, description="A format of the draft's family (draft.family's formats); default: the family's first."
    )
    dtype: DTypeName = Field("bfloat16", description="Float weights; d2t stays int64 and t2d bool.")
    verifier: str | None = Field(
        None, description="Where engines load the target from; default: its hub id (a local path otherwise)."
    )
