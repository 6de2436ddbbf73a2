"""On-disk format of generated hidden states: safetensors shards plus a JSON manifest.

The manifest holds each shard's sha256. A reader checks a shard's hash the first time it touches the shard (one
sequential read, after which the memory-mapped slices come from the page cache), so a flipped byte anywhere is
refused before a single sample of that shard is used, and `train` pays the hash once per shard per process.

A shard packs several samples end to end (tokens of all samples concatenated, `offsets` marks where
each begins), so reading one sample is a slice of a memory-mapped file:

    input_ids          int64  [sum T]
    loss_mask          bool   [sum T]
    aux_hidden_states  dtype  [sum T, len(aux_layer_ids) * H]   (concatenated in id order)
    hidden_state       dtype  [sum T, H]                        (pre-norm final state)
    offsets            int64  [n + 1]

The state tensors are those the recipe's family trains on (the manifest's `identity.target_states`): both, the
final state alone, or neither. A manifest written before that key existed holds both.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from speculators_train.data.splits import SPLITS
from speculators_train.errors import UserError
from speculators_train.files import atomic_write_bytes, sha256_bytes, sha256_file
from speculators_train.layout import MANIFEST, TOKEN_FREQ
from speculators_train.loading import open_tensors, read_json, reading

FORMAT = "speculators_train.hidden_states"
VERSION = 1
TENSORS = ("input_ids", "loss_mask", "aux_hidden_states", "hidden_state", "offsets")
STATE_TENSORS = {"aux+final": ("aux_hidden_states", "hidden_state"), "final": ("hidden_state",), "none": ()}


def tensor_names(states: str) -> tuple[str, ...]:
    """The tensors of a shard holding `states` ("aux+final", "final" or "none"); `offsets` last."""
    return ("input_ids", "loss_mask", *STATE_TENSORS[states], "offsets")


def held_states(identity: dict[str, Any]) -> str:
    """The target states a shard set holds ("aux+final", "final" or "none"), from its manifest identity."""
    return identity.get("target_states", "aux+final")


def pack_samples(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    lengths = [len(s["input_ids"]) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    packed = {key: torch.cat([s[key] for s in samples]) for key in TENSORS[:-1] if key in samples[0]}
    packed["offsets"] = offsets
    return packed


def write_shard(path: Path, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Serialise, checksum and atomically write one shard; returns its manifest entry."""
    packed = pack_samples(samples)
    data = save(packed, metadata={"format": FORMAT, "sample_ids": json.dumps([s["id"] for s in samples])})
    atomic_write_bytes(path, data)
    return {
        "file": path.name,
        "sha256": sha256_bytes(data),
        "bytes": len(data),
        "num_samples": len(samples),
        "num_tokens": int(packed["input_ids"].numel()),
        "num_loss_tokens": int(packed["loss_mask"].sum()),
    }


def shard_name(rank: int, index: int) -> str:
    return f"shard-r{rank:03d}-{index:06d}.safetensors"


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not path.is_file():
        raise UserError(f"{directory}: no {MANIFEST}; run `speculators-train generate <recipe>` first")
    manifest = read_json(path, "hidden-state manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise UserError(f"{path}: not a {FORMAT} v{VERSION} manifest")
    if problem := _manifest_problem(manifest):
        raise UserError(f"{path}: {problem} (edited, or written by another version: regenerate the states)")
    return manifest


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# The fields its readers compute with: identity key -> (what it must be, the test)
IDENTITY_FIELDS: dict[str, tuple[str, Any]] = {
    "aux_layer_ids": ("a list of layer ids", lambda v: isinstance(v, list) and all(map(_is_count, v))),
    "hidden_size": ("a whole number above 0", lambda v: _is_count(v) and v > 0),
    "vocab_size": ("a whole number above 0", lambda v: _is_count(v) and v > 0),
    "storage_dtype": ("a dtype's name", lambda v: v in ("float32", "bfloat16", "float16")),
    "data_fingerprint": ("a string", lambda v: isinstance(v, str)),
}


def _manifest_problem(manifest: dict[str, Any]) -> str | None:
    """The first field of a manifest its readers cannot compute with (None: none)."""
    identity = manifest.get("identity")
    if not isinstance(identity, dict):
        return f"field `identity` is {'missing' if identity is None else 'not an object'}"
    for key, (what, ok) in IDENTITY_FIELDS.items():
        if not ok(identity.get(key)):
            return f"field `identity.{key}` must be {what}"
    splits = manifest.get("splits")
    for split in SPLITS:
        listed = splits.get(split) if isinstance(splits, dict) else None
        shards = listed.get("shards") if isinstance(listed, dict) else None
        if not isinstance(shards, list) or not all(isinstance(e, dict) for e in shards):
            return f"field `splits.{split}.shards` must be a list of objects"
        for i, entry in enumerate(shards):
            where = f"field `splits.{split}.shards[{i}]"
            if not (_is_count(entry.get("num_samples")) and _is_count(entry.get("num_tokens"))):
                return f"{where}` must count its samples and tokens (num_samples, num_tokens)"
            named = isinstance(entry.get("file"), str) and isinstance(entry.get("sha256"), str)
            if entry["num_samples"] and not named:
                return f"{where}` must name its file and sha256"
    if not isinstance(manifest.get("token_freq_sha256", ""), str):
        return "field `token_freq_sha256` must be a string"
    return None


def read_token_freq(directory: Path, manifest: dict[str, Any]) -> torch.Tensor:
    """Loss-masked train token counts, checked against the manifest's sha256 where it records one."""
    path = directory / TOKEN_FREQ
    if "token_freq_sha256" in manifest:
        check_sha256(path, manifest["token_freq_sha256"])
    with open_tensors(path, "token counts") as fh:
        return fh.get_tensor("token_freq")


@dataclass
class ShardIndex:
    path: Path
    offsets: list[int]
    ids: list[str]
    sha256: str


def _index_problem(offsets: list[int], ids: Any, entry: dict[str, Any]) -> str | None:
    """What is wrong with a shard's sample index against its manifest entry (None: consistent)."""
    if not isinstance(ids, list) or len(ids) != entry["num_samples"]:
        held = len(ids) if isinstance(ids, list) else "no"
        return f"holds {held} sample ids, the manifest lists {entry['num_samples']}"
    if len(offsets) != len(ids) + 1 or offsets[0] != 0 or offsets[-1] != entry["num_tokens"]:
        return "sample offsets do not match the manifest"
    if any(b <= a for a, b in itertools.pairwise(offsets)):
        return "sample offsets are not increasing"
    return None


def check_sha256(path: Path, expected: str) -> None:
    """Refuse a file whose bytes differ from what the generator wrote."""
    with reading(path, "hidden-state shard"):
        actual = sha256_file(path)
    if actual != expected:
        raise UserError(
            f"{path}: checksum mismatch (the file changed or is corrupt since it was generated); "
            "`speculators-train validate` lists every damaged shard: delete them and their manifest, then rerun "
            "generate"
        )


class HiddenStateShards(torch.utils.data.Dataset):
    """Samples of one split of a completed generation, read lazily from memory-mapped shards, each shard's sha256
    checked on first use. `states` reads fewer state tensors than the set holds (what a family trains on)."""

    def __init__(self, directory: str | Path, split: str = "train", states: str | None = None) -> None:
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        if not self.manifest.get("complete"):
            raise UserError(f"{self.directory}: generation is not complete; rerun generate to finish it")
        self.shards: list[ShardIndex] = []
        self.index: list[tuple[int, int]] = []
        self.lengths: list[int] = []  # tokens per sample, for length-bucketed batching
        self.verified: set[int] = set()  # shards whose sha256 was checked by this process
        self.keys = tensor_names(states or held_states(self.manifest["identity"]))[:-1]  # per sample: no offsets
        for entry in self.manifest["splits"][split]["shards"]:
            if not entry["num_samples"]:
                continue
            path = self.directory / split / entry["file"]
            if not path.is_file():
                raise UserError(f"{path}: listed in {MANIFEST} but missing; run `speculators-train validate`")
            with open_tensors(path, "hidden-state shard") as fh:
                offsets = fh.get_tensor("offsets").tolist()
                ids = json.loads(fh.metadata()["sample_ids"])
            problem = _index_problem(offsets, ids, entry)
            if problem:
                raise UserError(f"{path}: {problem}; run `speculators-train validate`")
            self.index.extend((len(self.shards), i) for i in range(len(ids)))
            self.lengths.extend(b - a for a, b in itertools.pairwise(offsets))
            self.shards.append(ShardIndex(path, offsets, ids, entry["sha256"]))

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, item: int) -> dict[str, Any]:
        shard_no, i = self.index[item]
        shard = self.shards[shard_no]
        if shard_no not in self.verified:
            check_sha256(shard.path, shard.sha256)
            self.verified.add(shard_no)
        start, end = shard.offsets[i], shard.offsets[i + 1]
        with open_tensors(shard.path, "hidden-state shard") as fh:
            sample = {key: fh.get_slice(key)[start:end] for key in self.keys}
        sample["id"] = shard.ids[i]
        return sample


def validate(directory: Path) -> list[str]:
    """Check every listed shard against the manifest; returns the problems found (empty = valid)."""
    manifest = read_manifest(directory)
    identity = manifest["identity"]
    width = len(identity["aux_layer_ids"]) * identity["hidden_size"]
    dtype = getattr(torch, identity["storage_dtype"])
    held = STATE_TENSORS[held_states(identity)]
    problems = [] if manifest.get("complete") else [f"{directory}: generation not complete"]
    loss_tokens_train = 0
    for split in SPLITS:
        listed = set()
        for entry in manifest["splits"][split]["shards"]:
            if not entry["num_samples"]:
                continue
            path = directory / split / entry["file"]
            listed.add(entry["file"])
            if not path.is_file():
                problems.append(f"{path}: listed in the manifest but missing")
                continue
            if sha256_file(path) != entry["sha256"]:
                problems.append(f"{path}: checksum mismatch (file changed or corrupt)")
                continue
            with open_tensors(path, "hidden-state shard") as fh:
                names = fh.keys()  # safetensors' reader is not iterable
                t = {key: fh.get_tensor(key) for key in names}
            if sorted(t) != sorted(tensor_names(held_states(identity))):
                problems.append(f"{path}: holds {sorted(t)}, the manifest's states are {held_states(identity)!r}")
                continue
            n_tok = t["input_ids"].numel()
            shapes = {"aux_hidden_states": (n_tok, width), "hidden_state": (n_tok, identity["hidden_size"])}
            checks = {
                "offsets": t["offsets"].numel() == entry["num_samples"] + 1 and t["offsets"][-1] == n_tok,
                "loss_mask": t["loss_mask"].numel() == n_tok and int(t["loss_mask"].sum()) == entry["num_loss_tokens"],
                **{key: t[key].shape == shapes[key] and t[key].dtype == dtype for key in held},
                "num_tokens": n_tok == entry["num_tokens"],
            }
            problems += [f"{path}: {name} does not match the manifest" for name, ok in checks.items() if not ok]
            if split == "train":
                loss_tokens_train += int(t["loss_mask"].sum())
        folder = directory / split
        if folder.is_dir():
            problems += [
                f"{p}: shard file not listed in the manifest"
                for p in folder.glob("*.safetensors")
                if p.name not in listed
            ]
    freq_path = directory / TOKEN_FREQ
    if manifest.get("complete"):
        if not freq_path.is_file():
            problems.append(f"{freq_path}: missing")
        else:
            freq = read_token_freq(directory, manifest)
            if int(freq.sum()) != loss_tokens_train:
                problems.append(f"{freq_path}: counts {int(freq.sum())} tokens, shards hold {loss_tokens_train}")
    return problems
