"""Validated YAML files (recipes, data mixes, eval suites): one base section and one loader.

Unknown keys and wrong types fail with the file and the dotted key, e.g.
``recipes/eagle3.yaml: training.lerning_rate: unknown key (did you mean learning_rate?)``.
"""

from __future__ import annotations

import difflib
import importlib.util
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, field_validator

from speculators_train.errors import UserError
from speculators_train.loading import parse_yaml, read_yaml

DTypeName = Literal["float32", "bfloat16", "float16"]
M = TypeVar("M", bound="Section")

# The largest integer any setting may hold: what torch, numpy and the file formats store (int64).
MAX_INT = 2**63 - 1


def _huge_int(value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) > MAX_INT
    if isinstance(value, list | tuple):
        return any(_huge_int(v) for v in value)
    return isinstance(value, dict) and any(_huge_int(v) for v in value.values())


class Section(BaseModel):
    """Base for every section of a YAML file: unknown keys are errors, never silently ignored, and values are taken
    as written (strict): `batch_size: true` or `seed: "0"` is refused rather than read as 1 or 0. No number may be
    `.inf` or `.nan` (a rate, a pause, a temperature that is not a number poisons every step after it), and no
    integer may exceed int64, which is all torch and the file formats hold."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _fits_int64(cls, value: Any) -> Any:
        if _huge_int(value):
            raise ValueError("integers must lie within +-(2**63 - 1), what torch and the file formats store")
        return value

    # Where the YAML came from, for error messages and relative paths; not a key of the file.
    _source_path: Path | None = PrivateAttr(None)

    @property
    def source_path(self) -> Path | None:
        return self._source_path

    def resolve_path(self, value: str, key: str, directory: bool = False) -> Path:
        """A file named in this YAML: `pkg:PACKAGE/rel` (shipped in a Python package), absolute, or relative to
        this file's folder, then its parent (recipes/ and data/ sit side by side), then the working directory."""
        if value.startswith("pkg:"):
            package, _, rel = value[4:].partition("/")
            spec = importlib.util.find_spec(package)
            if spec is None or not spec.submodule_search_locations:
                raise UserError(f"{self.source_path}: {key}: package {package!r} is not installed")
            candidates = [Path(next(iter(spec.submodule_search_locations))) / rel]
        else:
            path = Path(value).expanduser()
            candidates = []
            if not path.is_absolute() and self.source_path is not None:
                candidates += [self.source_path.parent / path, self.source_path.parent.parent / path]
            candidates.append(path)
        for candidate in candidates:
            if candidate.is_dir() if directory else candidate.is_file():
                return candidate
        what = "directory" if directory else "file"
        other = next((c for c in candidates if c.exists()), None)
        if other is not None:
            raise UserError(f"{self.source_path}: {key}: {other} is not a {what}")
        tried = ", ".join(str(c) for c in candidates)
        raise UserError(f"{self.source_path}: {key}: {what} {value!r} not found (tried {tried})")


def _section_types(annotation: Any) -> list[type[BaseModel]]:
    """The section classes a field can hold: itself, or each member of a union (a tagged one included)."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [t for arg in typing.get_args(annotation) for t in _section_types(arg)]
    return [annotation] if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []


def _walk(model: type[BaseModel], loc: tuple) -> tuple[list[str], type[BaseModel] | None]:
    """The dotted key a user wrote for a pydantic error location (a tagged union's tag, which pydantic puts in the
    location, is not part of the file), and the section that key holds (None for a plain value)."""
    keys: list[str] = []
    current: type[BaseModel] | None = model
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        keys.append(str(part))
        field = current.model_fields.get(part) if current is not None and isinstance(part, str) else None
        if field is None:
            current = None
            continue
        members = _section_types(field.annotation)
        if len(members) > 1 and parts and str(parts[0]) in _tags(members):
            tag = str(parts.pop(0))
            members = [m for m in members if _tags([m]) == [tag]]
        current = members[0] if len(members) == 1 else None
    return keys, current


def _tags(members: list[type[BaseModel]]) -> list[str]:
    """Values of the `family`-style Literal discriminator of each member (empty for untagged sections)."""
    out = []
    for member in members:
        for field in member.model_fields.values():
            if typing.get_origin(field.annotation) is Literal and len(typing.get_args(field.annotation)) == 1:
                out.append(str(typing.get_args(field.annotation)[0]))
                break
    return out


def _format_error(path: Path, error: dict[str, Any], model: type[BaseModel], moved: dict[str, str]) -> str:
    keys, _ = _walk(model, tuple(error["loc"]))
    key = ".".join(keys) or "<root>"
    kind = error["type"]
    if kind == "extra_forbidden" and key in moved:
        return f"{path}: {key}: moved to {moved[key]}"
    if kind == "extra_forbidden":
        _, parent = _walk(model, tuple(error["loc"])[:-1])
        allowed = list(parent.model_fields) if parent is not None else []
        hint = difflib.get_close_matches(keys[-1], allowed, n=1)
        suggestion = f" (did you mean {hint[0]}?)" if hint else f" (allowed: {', '.join(sorted(allowed))})"
        return f"{path}: {key}: unknown key{suggestion}"
    if kind == "value_error" and not error["loc"]:  # a rule across sections: its message names the keys
        return f"{path}: {error['msg'].removeprefix('Value error, ')}"
    if kind == "missing":
        return f"{path}: {key}: required key is missing"
    if kind in ("union_tag_not_found", "union_tag_invalid"):
        loc = tuple(error["loc"])
        _, parent = _walk(model, loc[:-1])
        field = parent.model_fields.get(loc[-1]) if parent is not None else None
        tags = ", ".join(repr(t) for t in _tags(_section_types(field.annotation))) if field is not None else ""
        tag_key = error["ctx"]["discriminator"].strip("'")
        got = "is missing" if kind == "union_tag_not_found" else f"{error['ctx']['tag']!r} is not registered"
        return f"{path}: {key}.{tag_key}: {got} (one of {tags})"
    message = error["msg"].removeprefix("Value error, ")
    return f"{path}: {key}: {message} (got {_short_repr(error.get('input'))})"


def _short_repr(value: Any) -> str:
    """A bounded repr of what the file held: a huge or deeply shared value never floods (or hangs) the message."""
    limits = reprlib.Repr()
    limits.maxlevel, limits.maxstring, limits.maxother, limits.maxlist, limits.maxdict = 2, 60, 60, 6, 6
    return limits.repr(value)


def read_yaml_mapping(path: str | Path, what: str) -> dict[str, Any]:
    """A YAML file that must hold a mapping; a syntax error names the line and column."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path} not found" if not path.exists() else f"{what} {path} is not a file")
    raw = read_yaml(path, what)
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a {what} must be a YAML mapping, got {type(raw).__name__}")
    return raw


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Set dotted keys (`--set data.max_length=512`) in a raw mapping, creating sections on the way."""
    for dotted, value in overrides.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"override {dotted}: {part} is not a section")
        node[leaf] = value


def validate_mapping(
    path: Path, raw: dict[str, Any], model: type[M], what: str, moved: dict[str, str] | None = None
) -> M:
    """`raw` as `model`; every problem is reported as `file: dotted.key: what is wrong`."""
    try:
        loaded = model.model_validate(raw)
    except ValidationError as exc:
        messages = [_format_error(path, err, model, moved or {}) for err in exc.errors()]
        raise UserError(f"invalid {what}:\n  " + "\n  ".join(messages)) from None
    loaded._source_path = path
    return loaded


def load_yaml_model(path: str | Path, model: type[M], what: str, overrides: dict[str, Any] | None = None) -> M:
    """Load a YAML mapping into `model`, with `overrides` applied first."""
    raw = read_yaml_mapping(path, what)
    apply_overrides(raw, overrides or {})
    return validate_mapping(Path(path), raw, model, what)


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` options as overrides; values are YAML (`--set eval.temperatures=[0,1]`)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        shown = repr(pair if len(pair) <= 80 else pair[:60] + f"... ({len(pair):,} characters)")
        if not sep or not key:
            raise UserError(f"--set {shown}: expected KEY=VALUE, e.g. --set data.max_length=512")
        out[key] = parse_yaml(value, f"--set {shown}")
    return out
