"""On-disk format of generated hidden states: safetensors shards plus a JSON manifest.

A shard packs several samples end to end (tokens of all samples concatenated, `offsets` marks where
each begins), so reading one sample is a slice of a memory-mapped file:

    input_ids          int64  [sum T]
    loss_mask          bool   [sum T]
    aux_hidden_states  dtype  [sum T, len(aux_layer_ids) * H]   (concatenated in id order)
    hidden_state       dtype  [sum T, H]                        (pre-norm final state)
    offsets            int64  [n + 1]
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save

from speculators_train.data.splits import SPLITS
from speculators_train.errors import UserError
from speculators_train.files import atomic_write_bytes, read_json, sha256_bytes, sha256_file

FORMAT = "speculators_train.hidden_states"
VERSION = 1
MANIFEST = "manifest.json"
TOKEN_FREQ = "token_freq.safetensors"
TENSORS = ("input_ids", "loss_mask", "aux_hidden_states", "hidden_state", "offsets")


def pack_samples(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    lengths = [len(s["input_ids"]) for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    packed = {key: torch.cat([s[key] for s in samples]) for key in TENSORS[:-1]}
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
    return manifest


@dataclass
class ShardIndex:
    path: Path
    offsets: list[int]
    ids: list[str]


class HiddenStateShards(torch.utils.data.Dataset):
    """Samples of one split of a completed generation, read lazily from memory-mapped shards."""

    def __init__(self, directory: str | Path, split: str = "train") -> None:
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        if not self.manifest.get("complete"):
            raise UserError(f"{self.directory}: generation is not complete; rerun generate to finish it")
        self.shards: list[ShardIndex] = []
        self.index: list[tuple[int, int]] = []
        self.lengths: list[int] = []  # tokens per sample, for length-bucketed batching
        for entry in self.manifest["splits"][split]["shards"]:
            if not entry["num_samples"]:
                continue
            path = self.directory / split / entry["file"]
            if not path.is_file():
                raise UserError(f"{path}: listed in {MANIFEST} but missing; run `speculators-train validate`")
            with safe_open(path, framework="pt") as fh:
                offsets = fh.get_tensor("offsets").tolist()
                ids = json.loads(fh.metadata()["sample_ids"])
            self.index.extend((len(self.shards), i) for i in range(len(ids)))
            self.lengths.extend(b - a for a, b in itertools.pairwise(offsets))
            self.shards.append(ShardIndex(path, offsets, ids))

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, item: int) -> dict[str, Any]:
        shard_no, i = self.index[item]
        shard = self.shards[shard_no]
        start, end = shard.offsets[i], shard.offsets[i + 1]
        with safe_open(shard.path, framework="pt") as fh:
            sample = {key: fh.get_slice(key)[start:end] for key in TENSORS[:-1]}
        sample["id"] = shard.ids[i]
        return sample


def validate(directory: Path) -> list[str]:
    """Check every listed shard against the manifest; returns the problems found (empty = valid)."""
    manifest = read_manifest(directory)
    identity = manifest["identity"]
    width = len(identity["aux_layer_ids"]) * identity["hidden_size"]
    dtype = getattr(torch, identity["storage_dtype"])
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
            with safe_open(path, framework="pt") as fh:
                t = {key: fh.get_tensor(key) for key in TENSORS}
            n_tok = t["input_ids"].numel()
            checks = {
                "offsets": t["offsets"].numel() == entry["num_samples"] + 1 and t["offsets"][-1] == n_tok,
                "loss_mask": t["loss_mask"].numel() == n_tok and int(t["loss_mask"].sum()) == entry["num_loss_tokens"],
                "aux_hidden_states": t["aux_hidden_states"].shape == (n_tok, width)
                and t["aux_hidden_states"].dtype == dtype,
                "hidden_state": t["hidden_state"].shape == (n_tok, identity["hidden_size"])
                and t["hidden_state"].dtype == dtype,
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
            with safe_open(freq_path, framework="pt") as fh:
                freq = fh.get_tensor("token_freq")
            if int(freq.sum()) != loss_tokens_train:
                problems.append(f"{freq_path}: counts {int(freq.sum())} tokens, shards hold {loss_tokens_train}")
    return problems
