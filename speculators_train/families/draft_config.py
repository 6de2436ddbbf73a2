"""Draft configs as pydantic dataclasses: each field's type and bounds are declared once, on the config itself, and
`checked` reads a config from a file's values with one-line refusals that name the field as the file spells it.

Types are strict (a JSON bool or float is not an integer, the string "false" is not a bool) and a JSON null reads
as a missing key, as engines read one. Bounds that depend on another field (a draft vocabulary within the target's)
are checked by each family's reader after `checked`, with `within`, in the same words.
"""

from __future__ import annotations

import itertools
import typing
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import annotated_types
from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, StrictFloat, StrictInt, TypeAdapter
from pydantic import ValidationError as PydanticError
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic.fields import FieldInfo

from speculators_train.families.format_common import MAX_HIDDEN, MAX_LAYERS, MAX_VOCAB, shown

T = TypeVar("T")

# A draft config: unknown fields refused, each field validated on construction.
draft_config = pydantic_dataclass(config=ConfigDict(extra="forbid"))


def Bounded(low: int, high: int) -> Any:
    """A JSON integer (not a bool or a float) in low..high."""
    return Annotated[StrictInt, Field(ge=low, le=high)]


Hidden = Bounded(1, MAX_HIDDEN)  # a model width
Vocab = Bounded(1, MAX_VOCAB)  # a vocabulary size
PositiveNumber = Annotated[StrictFloat, Field(gt=0, allow_inf_nan=False)]  # an epsilon; an integer is accepted


def _a_list(value: Any) -> Any:
    if not isinstance(value, list) or not value:
        raise ValueError(f"must be a non-empty list of layer ids, got {shown(value)}")
    return value


def _ascending(ids: list[int]) -> list[int]:
    if any(b <= a for a, b in itertools.pairwise(ids)):
        raise ValueError(f"{ids} must be distinct and ascending")
    return ids


# Aux layer ids: engines capture the states in layer order, each once; 0 is the embeddings.
LayerIds = Annotated[list[Bounded(0, MAX_LAYERS - 1)], BeforeValidator(_a_list), AfterValidator(_ascending)]


def spelled(keys: dict[str, str] | None) -> Callable[[str], str]:
    """How a file spells a field (`keys` maps a field to its spelling where it differs, as in an export format)."""
    keys = keys or {}
    return lambda field: keys.get(field, field)


def within(value: int, low: int, high: int, name: str) -> int:
    """A bound that depends on another field, refused in `checked`'s words."""
    if not low <= value <= high:
        raise ValueError(f"{name} must be in {low}..{high}, got {value}")
    return value


def checked(config_type: type[T], values: dict[str, Any], keys: dict[str, str] | None = None, prefix: str = "") -> T:
    """`values` (a config's fields, as read from a file) as `config_type`, a pydantic dataclass or model. ValueError
    names the first bad field as `prefix` + its spelling in the file (`keys`, as in `spelled`)."""
    present = {k: v for k, v in values.items() if v is not None}
    try:
        return TypeAdapter(config_type).validate_python(present)
    except PydanticError as exc:
        raise ValueError(_refusal(exc.errors(), config_type, spelled(keys), prefix)) from None


# pydantic's error types -> our words for them (`{}`: the value, as `shown`); a positive number is the only float field.
_WORDS = {
    "missing": "is missing",
    "int_type": "must be an integer, got {}",
    "bool_type": "must be true or false, got {}",
    "dict_type": "must be a JSON object, got {}",
    "string_type": "must be a string, got {}",
    "greater_than": "must be a number above 0, got {}",
    "float_type": "must be a number above 0, got {}",
    "finite_number": "must be a number above 0, got {}",
}


def _refusal(errors: list[Any], config_type: type, spell: Callable[[str], str], prefix: str) -> str:
    unknown = sorted(
        str(e["loc"][0]) for e in errors if e["type"] in ("unexpected_keyword_argument", "extra_forbidden")
    )
    if unknown:
        return f"unknown keys {unknown}"
    error = errors[0]
    loc, kind, value = error["loc"], error["type"], error["input"]
    if not loc:  # the config as a whole (a check across its fields)
        return str(error["ctx"]["error"])
    name = prefix + spell(str(loc[0])) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
    if kind == "value_error":
        return f"{name} {error['ctx']['error']}"
    if kind in ("greater_than_equal", "less_than_equal"):
        low, high = _bounds(config_type, loc)
        return f"{name} must be in {low}..{high}, got {value}"
    if kind in _WORDS:
        return f"{name} {_WORDS[kind].format(shown(value))}"
    return f"{name}: {error['msg']}"


def _bounds(config_type: type, loc: tuple[Any, ...]) -> tuple[Any, Any]:
    """The ge/le bounds declared for the field at `loc`: on the field, or inside its type (an optional integer, the
    items of a list)."""
    field: FieldInfo = config_type.__pydantic_fields__[loc[0]]
    metadata = [*field.metadata, *_declared(field.annotation)]
    low = next((m.ge for m in metadata if isinstance(m, annotated_types.Ge)), None)
    high = next((m.le for m in metadata if isinstance(m, annotated_types.Le)), None)
    return low, high


def _declared(annotation: Any) -> list[Any]:
    found = []
    for arg in typing.get_args(annotation):
        if isinstance(arg, FieldInfo):
            found += arg.metadata
        elif isinstance(arg, annotated_types.BaseMetadata):
            found.append(arg)
        else:
            found += _declared(arg)
    return found
