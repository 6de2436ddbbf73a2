"""Hostile-input catalogue: damaged or hostile drafts, checkpoints and target directories.

Each case damages a copy of a valid directory (built once per module for the session target) and runs the
CLI on it: `export --checkpoint` reads every draft format and checkpoint, `verify` and `train` the same loader from
their own entries. Every one must end in one `error:` line naming the file and the key or tensor at fault (exit 2),
never a traceback, and never a draft accepted with weights or maps its engine would misread.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators_train.cli import main
from speculators_train.export.run import export
from speculators_train.families.drafts import check_fits, load_draft
from speculators_train.families.eagle.model import Eagle3Config, Eagle3Draft
from speculators_train.families.medusa.model import MedusaDraft
from speculators_train.families.vocab import build_vocab_mapping
from speculators_train.head import load_head_weights
from speculators_train.origin import resolve_origin
from speculators_train.recipe import load_recipe
from speculators_train.training.checkpoint import save_checkpoint
from tests.conftest import SHAREGPT, make_recipe, tiny_config
from tests.faults import clean_error, mount_tmpfs, run_cli

DRAFT_VOCAB = 64
TARGET_LAYERS = 8  # the session target, tests.targets.TINY


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict[str, Path]:
    """Valid drafts for the real target, one per kind a user can point at: our EAGLE-3 and Medusa checkpoints, their
    export formats (speculators, SGLang, vLLM Medusa), and a run directory whose best.json names a checkpoint."""
    root = tmp_path_factory.mktemp("base")
    recipe_path = make_recipe(root / "recipe", [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}])
    recipe = load_recipe(recipe_path)
    config, head = load_head_weights(tiny_config())
    torch.manual_seed(0)
    freq = torch.zeros(config.vocab_size)
    freq[torch.randperm(config.vocab_size)[:DRAFT_VOCAB]] = 1
    d2t, t2d = build_vocab_mapping(freq, DRAFT_VOCAB)
    eagle = Eagle3Draft(Eagle3Config.for_target(config, [2, 4, 5], DRAFT_VOCAB, False))
    medusa = MedusaDraft.for_target(config, torch.randn(DRAFT_VOCAB, config.hidden_size), d2t, t2d, 2, 1)
    with torch.no_grad():
        eagle.d2t.copy_(d2t)
        eagle.t2d.copy_(t2d)
        eagle.embed_tokens.weight.copy_(head["embed"])
    paths = {
        "recipe": recipe_path,
        "ckpt": save_checkpoint(root / "eagle3", 1, eagle, None, {"step": 1}, keep_last=1),
        "medusa-ckpt": save_checkpoint(root / "medusa", 1, medusa, None, {"step": 1}, keep_last=1),
    }
    for kind, fmt in (("spec", "speculators"), ("sglang", "sglang")):
        paths[kind] = export(recipe, paths["ckpt"], fmt, root / kind, "float32").path
    paths["medusa-export"] = export(recipe, paths["medusa-ckpt"], "speculators", root / "medusa-export").path
    run = root / "run" / "train" / "checkpoints"
    shutil.copytree(paths["ckpt"], run / "step-000001")
    (run / "best.json").write_text(json.dumps({"step": 1, "metric": "al", "value": 1.0}))
    (run / "latest.json").write_text(json.dumps({"step": 1}))
    paths["run"] = root / "run"
    return paths


@pytest.mark.parametrize("kind", ["ckpt", "medusa-ckpt", "spec", "sglang", "medusa-export", "run"])
def test_every_undamaged_base_loads_and_fits_the_target(base, kind):
    """The control: each case below fails through its damage alone."""
    loaded = load_draft(base[kind], TARGET_LAYERS)
    check_fits(loaded, 128, 49152, TARGET_LAYERS)


# -- how a case damages its copy ----------------------------------------------------------------------------------
Damage = Callable[[Path], Any]
WEIGHTS = "model.safetensors"


def raw(data: bytes, name: str = WEIGHTS) -> Damage:
    return lambda d: (d / name).write_bytes(data)


def cut(at: Callable[[bytes], int], name: str = WEIGHTS) -> Damage:
    """Truncate the file at the byte `at(data)` returns."""

    def damage(d: Path) -> None:
        data = (d / name).read_bytes()
        (d / name).write_bytes(data[: at(data)])

    return damage


def header_length(data: bytes) -> int:
    return struct.unpack("<Q", data[:8])[0]


def header(meta: dict[str, Any], payload: bytes = b"\0" * 16) -> bytes:
    text = json.dumps(meta).encode()
    return struct.pack("<Q", len(text)) + text + payload


def tensors(change: Callable[[dict[str, torch.Tensor]], Any], name: str = WEIGHTS) -> Damage:
    """Rewrite the weights file with `change` applied to its tensors (a valid safetensors file again)."""

    def damage(d: Path) -> None:
        weights = load_file(d / name)
        change(weights)
        save_file({k: v.contiguous() for k, v in weights.items()}, d / name)

    return damage


def put(tensor_name: str, make: Callable[[torch.Tensor | None], torch.Tensor]) -> Damage:
    return tensors(lambda w: w.__setitem__(tensor_name, make(w.get(tensor_name))))


def drop(tensor_name: str) -> Damage:
    return tensors(lambda w: w.pop(tensor_name))


def offsets(change: Callable[[torch.Tensor], None]) -> Damage:
    """Edit d2t in place (a copy, so the change is written back)."""

    def make(d2t: torch.Tensor | None) -> torch.Tensor:
        d2t = d2t.clone()
        change(d2t)
        return d2t

    return put("d2t", make)


def swap_first_two(t: torch.Tensor) -> None:
    first = int(t[0])
    t[0], t[1] = t[1] + 1, first - 1  # ids 0 and 1 swapped: target ids go down


def config(path: str, value: Any, name: str) -> Damage:
    """Set the dotted key `path` of the JSON file `name` (a None value removes it)."""

    def damage(d: Path) -> None:
        data = json.loads((d / name).read_text())
        *parents, leaf = path.split(".")
        node = data
        for key in parents:
            node = node[key]
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
        (d / name).write_text(json.dumps(data))

    return damage


def draft_config(path: str, value: Any) -> Damage:
    return config(path, value, "draft_config.json")


def export_config(path: str, value: Any) -> Damage:
    return config(path, value, "config.json")


def both(*damages: Damage) -> Damage:
    return lambda d: [damage(d) for damage in damages]


@dataclass
class Case:
    id: str
    kind: str  # which base directory is copied and damaged
    damage: Damage
    file: str  # the file the message names (relative to the copy; "" for the directory itself)
    needles: tuple[str, ...] = ()


def weights_damage(kind: str, tag: str, damage: Damage, *needles: str) -> Case:
    return Case(f"{kind}-weights-{tag}", kind, damage, WEIGHTS, ("draft weights", *needles))


CASES = [
    # -- a damaged or hostile safetensors file: the header is read before anything is trusted
    weights_damage("ckpt", "empty", raw(b""), "header too small"),
    weights_damage("ckpt", "cut-inside-the-length", cut(lambda b: 5), "header too small"),
    weights_damage("ckpt", "cut-inside-the-header", cut(lambda b: 8 + header_length(b) // 2), "header"),
    weights_damage("ckpt", "cut-inside-the-data", cut(lambda b: len(b) - 100), "not fully covered"),
    weights_damage("ckpt", "garbage", raw(bytes(range(256)) * 16), "header"),
    weights_damage("ckpt", "header-length-2**60", raw(struct.pack("<Q", 1 << 60) + b"{}"), "header too large"),
    weights_damage("ckpt", "header-not-json", raw(struct.pack("<Q", 9) + b"{not json"), "header"),
    weights_damage(
        "ckpt",
        "header-claims-2**60-bytes",
        raw(header({"fc.weight": {"dtype": "F32", "shape": [1 << 40, 1 << 20], "data_offsets": [0, 1 << 62]}})),
        "overflow",
    ),
    weights_damage(
        "ckpt",
        "offsets-past-the-end",
        raw(header({"fc.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}})),
        "header",
    ),
    weights_damage("ckpt", "missing", lambda d: (d / WEIGHTS).unlink(), "is missing"),
    weights_damage("ckpt", "a-directory", lambda d: ((d / WEIGHTS).unlink(), (d / WEIGHTS).mkdir())),
    weights_damage("spec", "cut-inside-the-data", cut(lambda b: len(b) // 2), "not fully covered"),
    weights_damage("sglang", "garbage", raw(b"\xff" * 4096), "header"),
    weights_damage("medusa-export", "empty", raw(b""), "header too small"),
    weights_damage("medusa-ckpt", "cut-inside-the-header", cut(lambda b: 8 + header_length(b) // 3), "header"),
    Case(
        "spec-weights-a-tensor-in-two-files",
        "spec",
        lambda d: save_file({"fc.weight": torch.zeros(128, 384)}, d / "extra.safetensors"),
        "",
        ("['fc.weight'] also in another .safetensors file",),
    ),
    Case(
        "spec-weights-only-pickled",
        "spec",
        lambda d: ((d / WEIGHTS).unlink(), (d / "pytorch_model.bin").write_bytes(b"pickle")),
        "",
        ("no .safetensors weights", "pytorch_model.bin", "never unpickles"),
    ),
    # -- a config that is not one
    Case(
        "ckpt-config-not-json",
        "ckpt",
        raw(b'{"family": "eagle3",', "draft_config.json"),
        "draft_config.json",
        ("not valid JSON",),
    ),
    Case(
        "ckpt-config-a-list", "ckpt", raw(b"[]", "draft_config.json"), "draft_config.json", ("must be a JSON object",)
    ),
    Case(
        "ckpt-config-not-utf8",
        "ckpt",
        raw(b'{"family": "\xff"}', "draft_config.json"),
        "draft_config.json",
        ("not valid UTF-8",),
    ),
    Case("ckpt-config-missing", "ckpt", lambda d: (d / "draft_config.json").unlink(), "", ("no draft checkpoint",)),
    Case(
        "ckpt-config-unknown-family",
        "ckpt",
        draft_config("family", "eagle9"),
        "draft_config.json",
        ('family "eagle9" is not a draft family',),
    ),
    Case(
        "ckpt-config-family-a-list",
        "ckpt",
        draft_config("family", ["eagle3"]),
        "draft_config.json",
        ("is not a draft family",),
    ),
    Case(
        "ckpt-config-unknown-key",
        "ckpt",
        draft_config("surprise", 1),
        "draft_config.json",
        ("unknown keys ['surprise']",),
    ),
    Case(
        "ckpt-config-layer-not-an-object",
        "ckpt",
        draft_config("layer_config", 5),
        "draft_config.json",
        ("layer_config must be a JSON object",),
    ),
    # -- absurd values, refused before anything is built
    Case(
        "ckpt-hidden-size-10**9",
        "ckpt",
        draft_config("layer_config.hidden_size", 10**9),
        "draft_config.json",
        ("layer_config.hidden_size must be in 1..65536, got 1000000000",),
    ),
    Case(
        "ckpt-negative-vocab",
        "ckpt",
        draft_config("layer_config.vocab_size", -5),
        "draft_config.json",
        ("layer_config.vocab_size must be in 1..4194304, got -5",),
    ),
    Case(
        "ckpt-vocab-10**9",
        "ckpt",
        draft_config("target_vocab_size", 10**9),
        "draft_config.json",
        ("target_vocab_size must be in 0..4194304",),
    ),
    Case(
        "ckpt-zero-attention-heads",
        "ckpt",
        draft_config("layer_config.num_attention_heads", 0),
        "draft_config.json",
        ("layer_config.num_attention_heads must be in 1..128, got 0",),
    ),
    Case(
        "ckpt-heads-not-dividing-hidden",
        "ckpt",
        both(
            draft_config("layer_config.head_dim", None),
            draft_config("layer_config.num_attention_heads", 7),
            draft_config("layer_config.num_key_value_heads", 1),
        ),
        "draft_config.json",
        ("layer_config.num_attention_heads 7 must divide layer_config.hidden_size 128",),
    ),
    Case(
        "ckpt-kv-heads-not-dividing-heads",
        "ckpt",
        draft_config("layer_config.num_key_value_heads", 3),
        "draft_config.json",
        ("num_key_value_heads 3 must divide layer_config.num_attention_heads 4",),
    ),
    Case(
        "ckpt-odd-head-dim",
        "ckpt",
        draft_config("layer_config.head_dim", 63),
        "draft_config.json",
        ("layer_config.head_dim 63", "odd"),
    ),
    Case(
        "ckpt-negative-eps",
        "ckpt",
        draft_config("layer_config.rms_norm_eps", -1e-5),
        "draft_config.json",
        ("layer_config.rms_norm_eps must be a number above 0",),
    ),
    Case(
        "ckpt-rope-theta-zero",  # loads and runs with every logit NaN
        "ckpt",
        draft_config("layer_config.rope_parameters.rope_theta", 0),
        "draft_config.json",
        ("layer_config.rope_parameters.rope_theta is 0; it must be above 0",),
    ),
    Case(
        "ckpt-unknown-activation",
        "ckpt",
        draft_config("layer_config.hidden_act", "warp"),
        "draft_config.json",
        ('layer_config.hidden_act "warp" is not an activation',),
    ),
    Case(
        "ckpt-string-for-an-int",
        "ckpt",
        draft_config("draft_vocab_size", "64"),
        "draft_config.json",
        ('draft_vocab_size must be an integer, got "64"',),
    ),
    Case(
        "ckpt-float-for-an-int",
        "ckpt",
        draft_config("draft_vocab_size", 64.0),
        "draft_config.json",
        ("draft_vocab_size must be an integer, got 64.0",),
    ),
    Case(
        "ckpt-bool-for-an-int",
        "ckpt",
        draft_config("target_hidden_size", True),
        "draft_config.json",
        ("target_hidden_size must be an integer, got true",),
    ),
    Case(
        "ckpt-string-for-a-bool",
        "ckpt",
        draft_config("norm_before_residual", "false"),
        "draft_config.json",
        ('norm_before_residual must be true or false, got "false"',),
    ),
    Case(
        "ckpt-draft-vocab-above-target-vocab",
        "ckpt",
        draft_config("draft_vocab_size", 49153),
        "draft_config.json",
        ("draft_vocab_size must be in 1..49152, got 49153",),
    ),
    Case(
        "ckpt-negative-layer-count",
        "ckpt",
        draft_config("target_num_layers", -1),
        "draft_config.json",
        ("target_num_layers must be in 0..4096, got -1",),
    ),
    Case(
        "ckpt-embedding-past-its-cap",
        "ckpt",
        both(draft_config("layer_config.hidden_size", 2304), draft_config("target_vocab_size", 4_000_000)),
        "draft_config.json",
        ("the target embedding it describes (4000000 ids x 2304) exceeds 4294967296 elements",),
    ),
    Case(
        "ckpt-empty-aux-ids",
        "ckpt",
        draft_config("aux_layer_ids", []),
        "draft_config.json",
        ("aux_layer_ids must be a non-empty list of layer ids",),
    ),
    Case(
        "ckpt-descending-aux-ids",
        "ckpt",
        draft_config("aux_layer_ids", [27, 15, 2]),
        "draft_config.json",
        ("aux_layer_ids [27, 15, 2] must be distinct and ascending",),
    ),
    Case(
        "ckpt-negative-aux-id",
        "ckpt",
        draft_config("aux_layer_ids", [-1, 15, 27]),
        "draft_config.json",
        ("aux_layer_ids[0] must be in 0..4095, got -1",),
    ),
    Case(
        "ckpt-aux-ids-a-string",
        "ckpt",
        draft_config("aux_layer_ids", "2,15,27"),
        "draft_config.json",
        ("aux_layer_ids must be a non-empty list",),
    ),
    Case(
        "ckpt-rope-block-a-string",
        "ckpt",
        draft_config("layer_config.rope_parameters", "yarn"),
        "draft_config.json",
        ("draft config",),
    ),
    Case(
        "medusa-ckpt-zero-heads",
        "medusa-ckpt",
        draft_config("num_heads", 0),
        "draft_config.json",
        ("num_heads must be in 1..16, got 0",),
    ),
    Case(
        "medusa-ckpt-negative-blocks",
        "medusa-ckpt",
        draft_config("num_layers", -2),
        "draft_config.json",
        ("num_layers must be in 1..16, got -2",),
    ),
    Case(
        "medusa-ckpt-hidden-size-10**9",
        "medusa-ckpt",
        draft_config("hidden_size", 10**9),
        "draft_config.json",
        ("hidden_size must be in 1..65536",),
    ),
    # -- weights that do not fit their config
    Case(
        "ckpt-shape-mismatch",
        "ckpt",
        put("fc.weight", lambda t: torch.zeros(128, 256)),
        WEIGHTS,
        ("weights do not fit draft_config.json", "fc.weight has shape [128, 256], expected [128, 384]"),
    ),
    Case(
        "ckpt-config-wider-than-its-weights",
        "ckpt",
        draft_config("target_hidden_size", 1024),
        WEIGHTS,
        ("fc.weight has shape [128, 384], expected [128, 3072]",),
    ),
    Case("ckpt-missing-tensor", "ckpt", drop("lm_head.weight"), WEIGHTS, ("missing lm_head.weight",)),
    Case(
        "ckpt-extra-tensor",
        "ckpt",
        put("bogus.weight", lambda t: torch.zeros(2)),
        WEIGHTS,
        ("unexpected bogus.weight",),
    ),
    Case(
        "ckpt-int8-fc",
        "ckpt",
        put("fc.weight", lambda t: t.to(torch.int8)),
        WEIGHTS,
        ("fc.weight is int8, expected a float tensor",),
    ),
    Case(
        "ckpt-bool-norm",
        "ckpt",
        put("norm.weight", lambda t: t > 0),
        WEIGHTS,
        ("norm.weight is bool, expected a float tensor",),
    ),
    Case(
        "medusa-ckpt-int32-head",
        "medusa-ckpt",
        put("lm_heads.1.weight", lambda t: t.to(torch.int32)),
        WEIGHTS,
        ("lm_heads.1.weight is int32, expected a float tensor",),
    ),
    Case(
        "medusa-ckpt-missing-block",
        "medusa-ckpt",
        drop("blocks.1.layers.0.weight"),
        WEIGHTS,
        ("missing blocks.1.layers.0.weight",),
    ),
    # -- vocabulary maps: out of range, out of order, or float
    Case(
        "ckpt-d2t-past-the-target-vocab",
        "ckpt",
        offsets(lambda t: t.__setitem__(-1, 10**6)),
        WEIGHTS,
        ("d2t maps draft id 63 to target id 1000063, outside the target vocabulary 0..49151",),
    ),
    Case(
        "ckpt-d2t-below-zero",
        "ckpt",
        offsets(lambda t: t.__setitem__(0, -1)),
        WEIGHTS,
        ("d2t maps draft id 0 to target id -1",),
    ),
    Case(
        "ckpt-d2t-duplicate-id",
        "ckpt",
        offsets(lambda t: t.__setitem__(1, t[0] - 1)),
        WEIGHTS,
        ("d2t maps draft ids 0 and 1 to target ids", "must increase strictly"),
    ),
    Case("ckpt-d2t-descending", "ckpt", offsets(swap_first_two), WEIGHTS, ("must increase strictly",)),
    Case("ckpt-d2t-float", "ckpt", put("d2t", lambda t: t.float()), WEIGHTS, ("d2t is float32", "never float")),
    Case(
        "ckpt-d2t-wrong-length", "ckpt", put("d2t", lambda t: t[:10]), WEIGHTS, ("d2t has shape [10], expected [64]",)
    ),
    Case("ckpt-d2t-missing", "ckpt", drop("d2t"), WEIGHTS, ("d2t is missing",)),
    Case("ckpt-t2d-float", "ckpt", put("t2d", lambda t: t.float()), WEIGHTS, ("t2d is float32, expected bool",)),
    Case("ckpt-t2d-uint8", "ckpt", put("t2d", lambda t: t.to(torch.uint8)), WEIGHTS, ("t2d is uint8, expected bool",)),
    Case(
        "ckpt-t2d-wrong-length",
        "ckpt",
        put("t2d", lambda t: t[:100]),
        WEIGHTS,
        ("t2d has shape [100], expected [49152]",),
    ),
    Case(
        "ckpt-t2d-disagrees-with-d2t",
        "ckpt",
        put("t2d", lambda t: t.index_fill(0, t.nonzero()[0], False)),
        WEIGHTS,
        ("t2d drops target id", "but d2t maps a draft id to it"),
    ),
    # -- the speculators (vLLM) format
    Case("spec-config-a-list", "spec", raw(b"[1]", "config.json"), "config.json", ("must be a JSON object",)),
    Case(
        "spec-rope-theta-zero",  # the export would hand the zero to vLLM
        "spec",
        export_config("transformer_layer_config.rope_theta", 0),
        "config.json",
        ("transformer_layer_config.rope_theta is 0; it must be above 0",),
    ),
    Case(
        "spec-yarn-factor-negative",
        "spec",
        export_config(
            "transformer_layer_config.rope_scaling",
            {"rope_type": "yarn", "factor": -2.0, "original_max_position_embeddings": 2048},
        ),
        "config.json",
        ("transformer_layer_config.rope_scaling.factor is -2.0; it must be above 0",),
    ),
    Case(
        "spec-hidden-size-10**9",
        "spec",
        export_config("transformer_layer_config.hidden_size", 10**9),
        "config.json",
        ("transformer_layer_config.hidden_size must be in 1..65536",),
    ),
    Case(
        "spec-layer-config-missing",
        "spec",
        export_config("transformer_layer_config", None),
        "config.json",
        ("transformer_layer_config is missing",),
    ),
    Case(
        "spec-draft-vocab-a-string",
        "spec",
        export_config("draft_vocab_size", "64"),
        "config.json",
        ('draft_vocab_size must be an integer, got "64"',),
    ),
    Case(
        "spec-empty-aux-ids",
        "spec",
        export_config("eagle_aux_hidden_state_layer_ids", []),
        "config.json",
        ("eagle_aux_hidden_state_layer_ids must be a non-empty list",),
    ),
    Case(
        "spec-norm-before-residual-a-string",
        "spec",
        export_config("norm_before_residual", "no"),
        "config.json",
        ("norm_before_residual must be true or false",),
    ),
    Case(
        "spec-d2t-past-the-target-vocab-without-t2d",
        "spec",
        both(drop("t2d"), offsets(lambda t: t.__setitem__(-1, 10**6))),
        WEIGHTS,
        ("outside the target vocabulary",),
    ),
    Case("spec-int8-fc", "spec", put("fc.weight", lambda t: t.to(torch.int8)), WEIGHTS, ("fc.weight is int8",)),
    Case(
        "spec-shape-mismatch",
        "spec",
        put("layers.0.mlp.down_proj.weight", lambda t: t[:, :100]),
        WEIGHTS,
        ("layers.0.mlp.down_proj.weight has shape [128, 100], expected [128, 256]",),
    ),
    # -- the SGLang format
    Case(
        "sglang-aux-ids-not-integers",
        "sglang",
        export_config("eagle_config.eagle_aux_hidden_state_layer_ids", ["a"]),
        "config.json",
        ("eagle_config.eagle_aux_hidden_state_layer_ids must be a list of integers",),
    ),
    Case(
        "sglang-zero-heads",
        "sglang",
        export_config("num_attention_heads", 0),
        "config.json",
        ("num_attention_heads must be in 1..128, got 0",),
    ),
    Case(
        "sglang-shape-mismatch",
        "sglang",
        put("midlayer.self_attn.q_proj.weight", lambda t: t[:10]),
        WEIGHTS,
        ("midlayer.self_attn.q_proj.weight has shape [10, 256], expected [128, 256]",),
    ),
    Case(
        "sglang-architectures-a-number",
        "sglang",
        export_config("architectures", 5),
        "",
        ("no draft checkpoint there",),
    ),
    # -- the vLLM Medusa format
    Case(
        "medusa-export-token-map-past-the-vocab",
        "medusa-export",
        put("token_map", lambda t: t + 49152),
        WEIGHTS,
        ("token_map maps draft id 0 to target id",),
    ),
    Case(
        "medusa-export-token-map-float",
        "medusa-export",
        put("token_map", lambda t: t.float()),
        WEIGHTS,
        ("token_map is float32",),
    ),
    Case(
        "medusa-export-token-map-unsorted",
        "medusa-export",
        put("token_map", lambda t: t.flip(0)),
        WEIGHTS,
        ("token_map maps draft ids 0 and 1", "must increase strictly"),
    ),
    Case(
        "medusa-export-negative-blocks",
        "medusa-export",
        export_config("num_hidden_layers", -1),
        "config.json",
        ("num_hidden_layers must be in 1..16, got -1",),
    ),
    Case(
        "medusa-export-truncated-vocab-a-string",
        "medusa-export",
        export_config("truncated_vocab_size", "64"),
        "config.json",
        ('truncated_vocab_size must be an integer, got "64"',),
    ),
    Case(
        "medusa-export-int8-bias",
        "medusa-export",
        put("blocks.0.layers.0.bias", lambda t: t.to(torch.int8)),
        WEIGHTS,
        ("blocks.0.layers.0.bias is int8, expected a float tensor",),
    ),
    # -- what the export's card reads from the checkpoint
    Case(
        "ckpt-trainer-state-a-list",
        "ckpt",
        raw(b"[]", "trainer_state.json"),
        "trainer_state.json",
        ("trainer state must be a JSON object",),
    ),
    Case(
        "ckpt-trainer-state-best-value-a-string",
        "ckpt",
        config("best", {"metric": "al", "value": "high", "step": 1}, "trainer_state.json"),
        "trainer_state.json",
        ("trainer state: Unknown format code 'f'",),
    ),
    # -- checkpoint pointers of a run directory
    Case(
        "run-best-pointer-a-list",
        "run",
        raw(b"[]", "train/checkpoints/best.json"),
        "train/checkpoints/best.json",
        ("must be a JSON object",),
    ),
    Case(
        "run-best-step-a-string",
        "run",
        config("step", "one", "train/checkpoints/best.json"),
        "train/checkpoints/best.json",
        ('step must be an integer >= 0, got "one"',),
    ),
    Case(
        "run-damaged-checkpoint-behind-best",
        "run",
        raw(b"", f"train/checkpoints/step-000001/{WEIGHTS}"),
        f"train/checkpoints/step-000001/{WEIGHTS}",
        ("header too small",),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_damaged_draft_is_refused_in_one_line(tmp_path, capsys, base, case):
    bad = tmp_path / case.kind
    shutil.copytree(base[case.kind], bad)
    case.damage(bad)
    out = tmp_path / "out"
    argv = ["export", base["recipe"], "--checkpoint", bad, "--out", out]
    clean_error(argv, capsys, str(bad / case.file) if case.file else str(bad), *case.needles)
    assert not out.exists()


def test_a_verify_report_the_card_cannot_read_is_skipped_and_named_in_one_line(tmp_path, capsys, base):
    """The card quotes the newest `verify` results measured on the checkpoint exported: a record it cannot read
    (edited, another version's) is left out, and export says which and why instead of quoting it."""
    recipe = make_recipe(tmp_path / "r", [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}])
    report = tmp_path / "r" / "run" / "verify" / "20260101-000000" / "results.json"
    report.parent.mkdir(parents=True)
    report.write_text(json.dumps([{"checkpoint": str(base["ckpt"]), "suite": "s", "shape": "chain(K=5)"}]))
    out = tmp_path / "out"
    code, err = run_cli(["export", recipe, "--checkpoint", base["ckpt"], "--out", out], capsys)
    assert code == 0 and "Traceback" not in err, err
    note = f"1 verify record(s) skipped, not fit to compute with: {report}: record 0: no `num_speculative_tokens`"
    assert "".join(note.split()) in "".join(err.split())  # rich wraps long lines anywhere
    assert "Not measured yet" in (out / "README.md").read_text()


@pytest.mark.parametrize(
    ("command", "kind", "damage", "file", "needles"),
    [
        ("verify", "spec", put("d2t", lambda t: t.double()), WEIGHTS, ("d2t is float64",)),
        ("train", "ckpt", draft_config("layer_config.hidden_size", 10**9), "draft_config.json",
         ("layer_config.hidden_size must be in 1..65536",)),
    ],
    ids=["verify-draft-with-a-float-d2t", "train-init-from-hidden-size-10**9"],
)  # fmt: skip
def test_verify_and_train_refuse_a_damaged_draft_in_one_line(
    tmp_path, capsys, base, command, kind, damage, file, needles
):
    """The same loader behind `verify --draft` and `training.init_from` (both load the real target first)."""
    bad = tmp_path / kind
    shutil.copytree(base[kind], bad)
    damage(bad)
    sources = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}]
    if command == "verify":
        argv = ["verify", make_recipe(tmp_path / "r", sources), "--draft", bad]
    else:
        training = {"init_from": str(bad), "max_steps": 1}
        argv = [
            "train",
            make_recipe(tmp_path / "r", sources, generation={"hidden_states": "online"}, training=training),
        ]
    clean_error(argv, capsys, str(bad / file), *needles)


# -- target directories ----------------------------------------------------------------------------------------------
def target_files(files: dict[str, bytes | str | Path]) -> Damage:
    """A target directory holding `files`: bytes or text written as given, a Path copied from the real target."""

    def make(d: Path) -> None:
        d.mkdir()
        for name, content in files.items():
            if isinstance(content, Path):
                shutil.copy(content, d / name)
            elif isinstance(content, bytes):
                (d / name).write_bytes(content)
            else:
                (d / name).write_text(content)

    return make


def small_safetensors(**tensors: torch.Tensor) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()})


REAL = Path("REAL")  # stands for the real target's file of the same name
TOKENIZER = {"tokenizer.json": REAL, "tokenizer_config.json": REAL, "chat_template.jinja": REAL}
# case: (files, needles); refused by every command the same way, before any target file is opened by transformers
EARLY = {
    "pickle-only": (
        {"config.json": REAL, "pytorch_model.bin": b"\\x80\\x02pickle"},
        ("holds only pickled weights (pytorch_model.bin)", "never loads", "safe_serialization=True"),
    ),
    "no-weights-at-all": ({"config.json": REAL}, ("has no model.safetensors",)),
    "config-not-json": (
        {"config.json": "{", "model.safetensors": REAL},
        ("config.json: target config is not valid JSON",),
    ),
    "config-a-list": ({"config.json": "[]", "model.safetensors": REAL}, ("target config must be a JSON object",)),
    "index-names-a-missing-shard": (
        {
            "config.json": REAL,
            "model.safetensors.index.json": '{"weight_map": {"lm_head.weight": "model-1.safetensors"}}',
        },
        ("weight files ['model-1.safetensors'] named by model.safetensors.index.json are missing",),
    ),
    "index-without-a-map": (
        {"config.json": REAL, "model.safetensors.index.json": '{"weight_map": 5}'},
        ("weight_map must map tensor names to file names",),
    ),
    # a config no model runs with: every state NaN, or a vocabulary that asks for terabytes
    "config-negative-norm-eps": (
        {"config.json": {"rms_norm_eps": -1}, "model.safetensors": REAL},
        (
            "target.name_or_path:",
            "config.json: rms_norm_eps is -1; it must be above 0",
        ),
    ),
    "config-zero-rope-theta": (
        {"config.json": {"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "model.safetensors": REAL},
        ("rope_parameters.rope_theta is 0; it must be above 0",),
    ),
    "config-nan": (
        {
            "config.json": {"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}},
            "model.safetensors": REAL,
        },
        ("rope_parameters.rope_theta is nan, not a finite number",),
    ),
    "config-vocab-10**12": (
        {"config.json": {"vocab_size": 10**12}, "model.safetensors": REAL},
        ("vocab_size is 1000000000000; it must be an integer in 1..4,194,304",),
    ),
    "custom-code": (
        {"config.json": {"model_type": "mine", "auto_map": {"AutoConfig": "mine.MyConfig"}}, "model.safetensors": REAL},
        ("loads only through its own code", "config.json (model_type 'mine')", "never runs"),
    ),
}
# case: (files, needles of `export`, which reads the head, needle of `verify`, which loads the whole target through
# transformers: it would run a model whose tensors its files lack at random values, so that is refused too)
LATE = {
    "config-unknown-model-type": (
        {"config.json": '{"model_type": "no-such-model"}', "model.safetensors": REAL},
        ("config.json: target config:", "no-such-model"),
        None,  # verify reads the config before any model (which engine serves it): export's line
    ),
    "weights-truncated": (
        {"config.json": REAL, "model.safetensors": small_safetensors(a=torch.zeros(64, 64))[:-100]},
        ("model.safetensors: target weights:", "not fully covered"),
        "not fully covered",
    ),
    "weights-without-the-model": (
        {"config.json": REAL, "model.safetensors": small_safetensors(a=torch.zeros(2))},
        ("tensor model.embed_tokens.weight not found in",),
        "its weights lack 75 tensors of the model",
    ),
}


def target_recipe(tmp_path: Path, files: dict[str, Any]) -> tuple[Path, Path]:
    """(a recipe whose target is a directory of `files`, that directory)."""
    real = Path(resolve_origin(tiny_config())[0])
    target = tmp_path / "target"
    written = {}
    for name, content in files.items():
        if isinstance(content, dict):  # the real file with these keys changed
            content = json.dumps({**json.loads((real / name).read_text()), **content})
        written[name] = real / name if content is REAL else content
    target_files(written)(target)
    sources = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}]
    return make_recipe(tmp_path / "r", sources, target={"name_or_path": str(target)}), target


@pytest.mark.parametrize("case", list(EARLY), ids=list(EARLY))
def test_a_damaged_target_directory_is_refused_before_transformers_reads_it(tmp_path, capsys, base, case):
    """transformers' own errors on these are long tracebacks, and it would unpickle a pickle-only directory."""
    files, needles = EARLY[case]
    recipe, target = target_recipe(tmp_path, files)
    clean_error(
        ["export", recipe, "--checkpoint", base["ckpt"], "--out", tmp_path / "out"], capsys, str(target), *needles
    )
    clean_error(["verify", recipe, "--draft", base["ckpt"]], capsys, str(target), *needles)


@pytest.mark.parametrize("case", list(LATE), ids=list(LATE))
def test_a_target_directory_damaged_inside_its_files_is_refused_in_one_line(tmp_path, capsys, base, case):
    files, needles, loading = LATE[case]
    recipe, target = target_recipe(tmp_path, {**TOKENIZER, **files})
    clean_error(
        ["export", recipe, "--checkpoint", base["ckpt"], "--out", tmp_path / "out"], capsys, str(target), *needles
    )
    loaded = needles if loading is None else (f"could not load target '{target}'", loading)
    clean_error(["verify", recipe, "--draft", base["ckpt"]], capsys, *loaded)


@pytest.mark.parametrize(
    "content", [b"", b"GGUF" + bytes(60), bytes(range(256)) * 4], ids=["empty", "header-only", "garbage"]
)
def test_a_damaged_gguf_target_is_refused_in_one_line(tmp_path, capsys, base, content):
    gguf = tmp_path / "target.gguf"
    gguf.write_bytes(content)
    sources = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}]
    recipe = make_recipe(tmp_path / "r", sources, target={"name_or_path": str(gguf)})
    argv = ["export", recipe, "--checkpoint", base["ckpt"], "--out", tmp_path / "out"]
    clean_error(argv, capsys, f"could not read GGUF file {gguf}")


def test_a_target_config_naming_fewer_layers_than_its_weights_is_refused(tmp_path, capsys, base):
    """transformers loads such a target truncated (and says so only in a log line): it would be used silently."""
    config = json.loads((Path(resolve_origin(tiny_config())[0]) / "config.json").read_text())
    config["num_hidden_layers"] -= 2
    files = {**TOKENIZER, "config.json": json.dumps(config), "model.safetensors": REAL}
    recipe, target = target_recipe(tmp_path, files)
    clean_error(
        ["verify", recipe, "--draft", base["ckpt"]], capsys, f"could not load target '{target}'",
        "tensors its config.json does not describe",
    )  # fmt: skip


def test_a_target_tokenizer_without_a_chat_template_is_refused_by_verify(tmp_path, capsys, base):
    real = Path(resolve_origin(tiny_config())[0])
    tokenizer_config = json.loads((real / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    files = {
        "tokenizer.json": REAL, "tokenizer_config.json": json.dumps(tokenizer_config), "config.json": REAL,
        "model.safetensors": REAL,
    }  # fmt: skip
    recipe, target = target_recipe(tmp_path, files)
    clean_error(["verify", recipe, "--draft", base["ckpt"]], capsys, f"target {target}", "has no chat template")


def test_export_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, capsys, base):
    """safetensors raises its own error type on ENOSPC: export ends as every other writer does, with the disk-full
    line, and no half-written folder is left."""
    disk = tmp_path / "disk"
    if not mount_tmpfs(disk, 64 << 10):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        out = disk / "export"
        argv = ["export", base["recipe"], "--checkpoint", base["ckpt"], "--out", out]
        clean_error(argv, capsys, f"disk full while writing {out}", "rerun the same command")
        assert [p.name for p in disk.iterdir()] == [".export.lock"]  # the lock a rerun takes again; no export
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_export_paths_print_as_written_and_never_as_options(tmp_path, capsys, base, monkeypatch):
    """A path holding rich markup (`[/]`, `[bold]`) prints as written, and a relative output path that starts with
    `-` is written `./-...` in the serve lines (a shell would take it for an option)."""
    marked = tmp_path / "a[" / "]b[bold]"
    code, err = run_cli(["export", base["recipe"], "--checkpoint", base["ckpt"], "--out", marked], capsys)
    assert code == 0 and str(marked) in err.replace("\n", ""), err
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["export", str(base["recipe"]), "--checkpoint", str(base["ckpt"]), "--out=--trust-remote-code"])
    assert not done.value.code
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "vllm serve ./--trust-remote-code", lines
    assert (tmp_path / "--trust-remote-code" / "config.json").is_file()
