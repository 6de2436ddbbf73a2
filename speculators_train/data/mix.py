"""Data mixes (`data/*.yaml`): sources with weights and caps, a seed, and the held-out split by record id."""

from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, model_validator

from speculators_train.data.conversations import Conversation, SkipReport, normalize_record
from speculators_train.data.readers import Record, read_datasets, read_file
from speculators_train.errors import UserError
from speculators_train.loading import reading
from speculators_train.schema import Section, load_yaml_model


class SourceConfig(Section):
    name: str = Field(description="Unique name; prefixes record ids so sources never collide.")
    path: str | None = Field(None, description="Local JSON/JSONL/parquet file, or pkg:PACKAGE/relative/path.")
    hub: str | None = Field(None, description="A `datasets` hub id, e.g. HuggingFaceH4/ultrachat_200k.")
    subset: str | None = None
    split: str = "train"
    streaming: bool = Field(False, description="Stream a hub dataset: takes the first max_records, unshuffled.")
    weight: float = Field(1.0, gt=0, allow_inf_nan=False, description="Relative share when the mix sets total_records.")
    max_records: int | None = Field(None, gt=0, description="Cap on records taken from this source.")

    @model_validator(mode="after")
    def _one_location(self) -> SourceConfig:
        if (self.path is None) == (self.hub is None):
            raise ValueError(f"source {self.name!r}: give exactly one of path or hub")
        if self.streaming and (self.hub is None or self.max_records is None):
            raise ValueError(f"source {self.name!r}: streaming needs a hub id and max_records")
        return self


class MixConfig(Section):
    seed: int = 0
    total_records: int | None = Field(
        None, gt=0, le=2**53, description="If set, split across sources by weight (at most 2**53: exact as a float)."
    )
    sources: list[SourceConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> MixConfig:
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique, got {names}")
        # Each quota is total_records * weight / (sum of weights), in floats: refuse numbers that overflow them.
        weights = [s.weight for s in self.sources]
        if not (math.isfinite(sum(weights)) and math.isfinite((self.total_records or 1) * max(weights))):
            raise ValueError("total_records and source weights are too large to compute shares with; scale them down")
        return self


@dataclass
class Splits:
    train: list[Conversation]
    held_out: list[Conversation]
    report: SkipReport


def load_mix_config(path: str | Path) -> MixConfig:
    return load_yaml_model(path, MixConfig, "data mix")


# Sources read in this process, by content: a recipe's stages, `verify`'s suites and OSD's general suite read the
# same files again, and a 100 MB JSON costs seconds to parse but a fraction of one to hash. (A file's size and
# modification time would not do: a rewrite within one clock tick keeps both.) Files past `_READ_MAX_BYTES` are not
# kept, as their records would stay in memory for the life of the process. Cached conversations are shared: never
# mutate them.
_READ: OrderedDict[tuple, tuple[list[Conversation], SkipReport]] = OrderedDict()
_READ_FILES = 4
_READ_MAX_BYTES = 256 << 20


def _digest(path: Path, label: str) -> str | None:
    """sha256 of a file small enough to keep, else None."""
    digest = hashlib.sha256()
    with reading(label, "data file"), path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
            if fh.tell() > _READ_MAX_BYTES:
                return None
    return digest.hexdigest()


def read_source(mix: MixConfig, source: SourceConfig, report: SkipReport) -> list[Conversation]:
    """All records of one source, normalised; duplicate ids are skipped (they would break the id split). A local
    file this process has already read with the same bytes is not parsed again; its skips are reported again."""
    if source.path is None:
        raw = read_datasets(source.hub, source.subset, source.split, streaming=source.streaming)
        return _normalized(raw, source, report, None)
    path = mix.resolve_path(source.path, f"sources.{source.name}.path")
    digest = _digest(path, source.path)
    key = (source.name, str(path.resolve()), digest)  # a record's relative image paths are read from its folder
    if digest is not None and key in _READ:
        _READ.move_to_end(key)
        conversations, skipped = _READ[key]
    else:
        skipped = SkipReport()
        conversations = _normalized(read_file(path, skipped, label=source.path), source, skipped, path.resolve().parent)
        if digest is not None:
            _READ[key] = (conversations, skipped)
            while len(_READ) > _READ_FILES:
                _READ.popitem(last=False)
    report.merge(skipped)
    return list(conversations)


def _normalized(
    raw: Iterable[Record], source: SourceConfig, report: SkipReport, base: Path | None
) -> list[Conversation]:
    seen: set[str] = set()
    out: list[Conversation] = []
    for record, origin in raw:
        conv = normalize_record(record, source.name, origin, report, base)
        if conv is None:
            continue
        if conv.id in seen:
            report.skip("duplicate_id", f"{origin} id={conv.id}")
            continue
        seen.add(conv.id)
        out.append(conv)
        if source.streaming and len(out) >= source.max_records:
            break
    return out


def is_held_out(record_id: str, fraction: float) -> bool:
    """Decided by a hash of the id alone: stable across caps, mixes, ranks and reruns."""
    bucket = int.from_bytes(hashlib.sha256(record_id.encode()).digest()[:8], "big") / 2**64
    return bucket < fraction


def load_mix(path: str | Path, held_out_fraction: float) -> Splits:
    """Read every source, take each one's share (seeded shuffle, then cap), mix, and split by id."""
    mix = load_mix_config(path)
    report = SkipReport()
    per_source = {s.name: read_source(mix, s, report) for s in mix.sources}
    quotas = {}
    total_weight = sum(s.weight for s in mix.sources)
    for s in mix.sources:
        quota = len(per_source[s.name])
        if mix.total_records is not None:
            quota = min(quota, round(mix.total_records * s.weight / total_weight))
        if s.max_records is not None:
            quota = min(quota, s.max_records)
        quotas[s.name] = quota
    chosen: list[Conversation] = []
    for s in mix.sources:
        records = per_source[s.name]
        if not s.streaming:
            random.Random(f"{mix.seed}:{s.name}").shuffle(records)
        chosen.extend(records[: quotas[s.name]])
    random.Random(mix.seed).shuffle(chosen)
    if not chosen:
        detail = "; ".join(report.lines()) or "the sources hold no records"
        raise UserError(f"data mix {path}: no usable records ({detail})")
    train = [c for c in chosen if not is_held_out(c.id, held_out_fraction)]
    held_out = [c for c in chosen if is_held_out(c.id, held_out_fraction)]
    return Splits(train=train, held_out=held_out, report=report)
