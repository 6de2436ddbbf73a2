"""The one loading layer for files another person made: recipes, data mixes, data, shards, drafts, checkpoints, logs.

Every reader here turns any failure (missing, unreadable, truncated, invalid UTF-8, bad JSON/YAML, a damaged
safetensors header, nesting too deep to parse, out of memory) into a `UserError` that names the file and what is
wrong, so the CLI prints one line and exits 2 instead of a traceback. Nothing here unpickles: tensors come from
safetensors, and the few `torch.save` files we write ourselves are read with `weights_only=True`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from speculators_train.errors import UserError

# A YAML document may share nodes through aliases; printing or walking it expands them. Past this many values
# (counting each alias use at its full size) the file is refused as an alias bomb before anything walks it.
MAX_YAML_VALUES = 1_000_000


# Weight files only unpickling reads (running whatever code they hold): never loaded, only named in refusals.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def pickled_files(directory: Path) -> list[str]:
    """Names of the pickled weight files in `directory`, sorted."""
    return sorted(p.name for p in directory.iterdir() if p.is_file() and p.suffix in PICKLE_SUFFIXES)


def shown(value: Any) -> str:
    """A value from a file, short enough for a one-line message."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def printable(text: str) -> str:
    """`text` with every character a terminal would act on or hide (escape sequences, other controls, bidi and
    zero-width marks) written as its Python escape: a file name from elsewhere printed or stored as it reads."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def describe(exc: BaseException) -> str:
    """A short, single-line account of an exception (no traceback, no multi-line dumps)."""
    if isinstance(exc, RecursionError):
        return "nested too deeply to read"
    if isinstance(exc, MemoryError):
        return "too large to hold in memory"
    if isinstance(exc, KeyError):
        return f"missing key {exc.args[0]!r}" if exc.args else "missing key"
    if isinstance(exc, UnicodeDecodeError):
        return f"not valid UTF-8 at byte {exc.start}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


@contextlib.contextmanager
def reading(path: str | Path, what: str) -> Iterator[None]:
    """Run a read of `path`; any failure but a `UserError` becomes `UserError("PATH: WHAT: why")`."""
    try:
        yield
    except UserError:
        raise
    except FileNotFoundError:
        raise UserError(f"{path}: {what} is missing") from None
    except IsADirectoryError:
        raise UserError(f"{path}: {what} is a directory, expected a file") from None
    except Exception as exc:  # a damaged file may fail anywhere inside a parser: report it, never a traceback
        raise UserError(f"{path}: {what}: {describe(exc)}") from None


def decode_utf8(data: bytes, path: str | Path, what: str) -> str:
    """UTF-8 text (a leading byte-order mark dropped); invalid bytes are reported by line and column."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise UserError(f"{path}:{line}:{column}: {what} is not valid UTF-8 (byte {data[exc.start]:#04x})") from None


def read_text(path: str | Path, what: str) -> str:
    with reading(path, what):
        data = Path(path).read_bytes()
    return decode_utf8(data, path, what)


def read_json(path: str | Path, what: str) -> Any:
    """Parse a JSON file (one we wrote earlier, or a config made elsewhere); damage gets a message naming it."""
    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{path}: {what} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    except RecursionError:
        raise UserError(f"{path}: {what} is nested too deeply to read") from None


def read_json_object(path: str | Path, what: str) -> dict[str, Any]:
    value = read_json(path, what)
    if not isinstance(value, dict):
        raise UserError(f"{path}: {what} must be a JSON object, got {type(value).__name__}")
    return value


def _yaml_loader():
    import yaml

    class StrictLoader(yaml.SafeLoader):
        """SafeLoader that refuses a key written twice in one mapping (YAML would keep the last silently)."""

        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                self.flatten_mapping(node)
                seen: dict[Any, Any] = {}
                for key_node, _ in node.value:
                    key = self.construct_object(key_node, deep=True)
                    with contextlib.suppress(TypeError):
                        if key in seen:
                            first = seen[key].start_mark.line + 1
                            raise yaml.constructor.ConstructorError(
                                None,
                                None,
                                f"key {key!r} is written twice (first on line {first}); keep one",
                                key_node.start_mark,
                            )
                        seen[key] = key_node
            return super().construct_mapping(node, deep)

        def construct_yaml_int(self, node):
            try:
                return super().construct_yaml_int(node)
            except ValueError:  # past Python's limit on integer strings (4,300 digits): no setting is that long
                raise yaml.constructor.ConstructorError(
                    None, None, f"an integer of {len(node.value):,} characters is too long", node.start_mark
                ) from None

    StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
    return StrictLoader


def _expanded_size(value: Any, limit: int) -> int:
    """How many values `value` holds with every shared (aliased) node counted at each use; stops past `limit`."""
    sizes: dict[int, int] = {}

    def size(node: Any) -> int:
        if not isinstance(node, (dict, list)):
            return 1
        if id(node) in sizes:
            return sizes[id(node)]
        children = node.items() if isinstance(node, dict) else ((None, v) for v in node)
        total = 1
        for _, child in children:
            total += size(child)
            if total > limit:
                break
        sizes[id(node)] = total
        return total

    return size(value)


def parse_yaml(text: str, where: str) -> Any:
    """YAML text as plain values: safe types only, duplicate keys refused, alias bombs refused."""
    import yaml

    try:
        value = yaml.load(text, Loader=_yaml_loader())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise UserError(f"{where}{at}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    except RecursionError:
        raise UserError(f"{where}: YAML nested too deeply to read") from None
    if _expanded_size(value, MAX_YAML_VALUES) > MAX_YAML_VALUES:
        raise UserError(f"{where}: YAML aliases expand to more than {MAX_YAML_VALUES:,} values; write it out plainly")
    return value


def read_yaml(path: str | Path, what: str) -> Any:
    return parse_yaml(read_text(path, what), str(path))


def _not_a_directory(path: str | Path, what: str) -> None:
    """safetensors reports a directory as "No such device"; say what it is."""
    if Path(path).is_dir():
        raise UserError(f"{path}: {what} is a directory, expected a file")


def load_tensors(path: str | Path, what: str) -> dict[str, Any]:
    """Every tensor of a safetensors file (never a pickle); a truncated or garbage file is one clear line."""
    from safetensors.torch import load_file

    _not_a_directory(path, what)
    with reading(path, what):
        return load_file(str(path))


@contextlib.contextmanager
def open_tensors(path: str | Path, what: str) -> Iterator[Any]:
    """`safe_open` on a safetensors file, with failures inside the block reported as damage to that file."""
    from safetensors import safe_open

    _not_a_directory(path, what)
    with reading(path, what), safe_open(str(path), framework="pt") as fh:
        yield fh


def load_torch_state(path: str | Path, what: str) -> Any:
    """A `torch.save` file we wrote (optimizer state): tensors and plain containers only, never code."""
    import torch

    with reading(path, what):
        return torch.load(path, map_location="cpu", weights_only=True)
