"""Hostile and careless recipes and command lines: each is refused with one line naming the file and the key (or
the option), before any model or data is touched; none hangs, none is silently read as something else."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import write_jsonl
from tests.faults import clean_error

CHAT = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}


def base(tmp_path: Path) -> dict:
    data = write_jsonl(tmp_path / "chats.jsonl", [{**CHAT, "id": i} for i in range(4)])
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump({"seed": 0, "sources": [{"name": "c", "path": str(data)}]}))
    return {"name": "t", "output_dir": str(tmp_path / "run"), "data": {"mix": str(tmp_path / "mix.yaml")}}


def dumped(**changes) -> callable:
    """A recipe: the base with `changes` merged in (dotted keys create sections)."""

    def make(tmp_path: Path) -> str:
        recipe = base(tmp_path)
        for dotted, value in changes.items():
            node = recipe
            *parents, leaf = dotted.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        return yaml.safe_dump(recipe, sort_keys=False)

    return make


def text(body: str) -> callable:
    """A recipe given as raw YAML text after the base's three lines (`{mix}`/`{run}` filled in)."""

    def make(tmp_path: Path) -> str:
        recipe = base(tmp_path)
        head = f"name: t\noutput_dir: {recipe['output_dir']}\n"
        return head + body.format(mix=recipe["data"]["mix"], run=recipe["output_dir"])

    return make


BOMB = """a: &a ["x","x","x","x","x","x","x","x","x"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
data: {{mix: {mix}}}
"""

# (id, recipe maker, extra CLI args, what the one error line must say)
CASES = [
    ("typo-top-level", dumped(traning={"epochs": 1}), [], ["traning: unknown key (did you mean training?)"]),
    ("typo-nested", dumped(**{"training.lerning_rate": 1e-3}), [], ["training.lerning_rate: unknown key"]),
    ("typo-deep", dumped(**{"eval.tree.depht": 3}), [], ["eval.tree.depht: unknown key (did you mean depth?)"]),
    ("missing-data", text(""), [], ["data: required key is missing"]),
    ("missing-mix", dumped(data={}), [], ["data.mix: required key is missing"]),
    ("bool-as-int", dumped(**{"training.batch_size": True}), [], ["training.batch_size", "valid integer"]),
    ("bool-as-float", dumped(**{"training.learning_rate": True}), [], ["training.learning_rate", "valid number"]),
    ("string-as-int", dumped(seed="0"), [], ["seed: Input should be a valid integer"]),
    ("float-as-int", dumped(**{"training.epochs": 1.5}), [], ["training.epochs", "valid integer"]),
    ("list-as-int", dumped(**{"training.batch_size": [4]}), [], ["training.batch_size"]),
    ("int-as-string", dumped(name=7), [], ["name: Input should be a valid string"]),
    ("section-as-scalar", dumped(training=5), [], ["training"]),
    ("zero-batch", dumped(**{"training.batch_size": 0}), [], ["training.batch_size", "greater than 0"]),
    ("negative-lr", dumped(**{"training.learning_rate": -1.0}), [], ["training.learning_rate", "greater than 0"]),
    ("nan-lr", text("data: {{mix: {mix}}}\ntraining: {{learning_rate: .nan}}\n"), [], ["training.learning_rate"]),
    ("inf-lr", text("data: {{mix: {mix}}}\ntraining: {{learning_rate: .inf}}\n"), [], ["learning_rate", "finite"]),
    ("inf-poll", text("data: {{mix: {mix}}}\nosd: {{poll_seconds: .inf}}\n"), [], ["osd.poll_seconds", "finite"]),
    ("day-long-poll", dumped(**{"osd.poll_seconds": 1e9}), [], ["osd.poll_seconds", "less than or equal to 86400"]),
    ("inf-temperature", text("data: {{mix: {mix}}}\neval: {{temperatures: [0, .inf]}}\n"), [], ["temperatures.1"]),
    ("nan-top-p", text("data: {{mix: {mix}}}\neval: {{top_p: .nan}}\n"), [], ["eval.top_p", "finite"]),
    ("seed-2-70", dumped(seed=2**70), [], ["seed: Input should be less than or equal to 4294967295"]),
    ("seed-negative", dumped(seed=-1), [], ["seed: Input should be greater than or equal to 0"]),
    ("int-past-int64", dumped(**{"training.max_steps": 2**64}), [], ["training.max_steps: integers must lie"]),
    ("int-past-int64-in-list", dumped(**{"eval.vllm.speculative_tokens": [2**80]}), [], ["eval.vllm.speculative"]),
    ("k-huge", dumped(**{"eval.num_speculative_tokens": 10**6}), [], ["num_speculative_tokens", "less than or equal"]),
    ("k-huge-llama", dumped(**{"eval.llama_cpp.speculative_tokens": [3, 100]}), [], ["each K must be >= 1 and <="]),
    ("tree-depth-huge", dumped(**{"eval.tree.depth": 10**5}), [], ["eval.tree.depth", "less than or equal to 64"]),
    ("tree-top-k-past-vocab", dumped(**{"eval.tree.top_k": 9000}), [], ["eval.tree.top_k 9000", "from 8192 tokens"]),
    ("draft-vocab-past-int64", dumped(draft={"family": "medusa", "draft_vocab_size": 2**64}), [], ["draft_vocab_size"]),
    ("warmup-1", dumped(**{"training.warmup_ratio": 1.0}), [], ["training.warmup_ratio", "less than 1"]),
    ("held-out-1", dumped(**{"data.held_out_fraction": 1.0}), [], ["data.held_out_fraction"]),
    ("max-length-1", dumped(**{"data.max_length": 1}), [], ["data.max_length", "greater than 1"]),
    ("overlong-typo", dumped(**{"data.overlong": "trunc"}), [], ["data.overlong", "'truncate' or 'drop'"]),
    ("dtype-typo", dumped(**{"generation.storage_dtype": "bf16"}), [], ["generation.storage_dtype"]),
    ("device-typo", dumped(**{"target.device": "gpu"}), [], ["target.device", "'auto', 'cpu', 'cuda' or 'cuda:N'"]),
    ("aux-ids-empty", dumped(**{"target.aux_layer_ids": []}), [], ["target.aux_layer_ids", "non-empty"]),
    ("aux-ids-zero", dumped(**{"target.aux_layer_ids": [0, 5, 9]}), [], ["ids must be >= 1"]),
    ("aux-ids-repeated", dumped(**{"target.aux_layer_ids": [2, 2, 9]}), [], ["repeats [2]"]),
    ("aux-ids-descending", dumped(**{"target.aux_layer_ids": [9, 5, 2]}), [], ["not ascending", "[2, 5, 9]"]),
    ("aux-ids-two-for-eagle3", dumped(**{"target.aux_layer_ids": [2, 9]}), [], ["aux_layer_ids"]),
    ("aux-ids-strings", dumped(**{"target.aux_layer_ids": ["2", "5", "9"]}), [], ["target.aux_layer_ids.0"]),
    ("family-unknown", dumped(draft={"family": "eagle4"}), [], ["draft.family: 'eagle4' is not registered"]),
    ("family-missing", dumped(draft={"ttt_steps": 3}), [], ["draft.family: is missing"]),
    ("family-key-typo", dumped(draft={"family": "eagle3", "step_decy": 0.8}), [], ["did you mean step_decay?"]),
    ("old-layout", dumped(**{"training.algorithm": "eagle3"}), [], ["training.algorithm", "old layout"]),
    ("export-format", dumped(**{"export.format": "onnx"}), [], ["export.format 'onnx'"]),
    ("tree-shape", dumped(**{"eval.tree.shape": "wide"}), [], ["eval.tree.shape"]),
    ("temperatures-negative", dumped(**{"eval.temperatures": [-1.0]}), [], ["eval.temperatures"]),
    ("temperatures-empty", dumped(**{"eval.temperatures": []}), [], ["eval.temperatures"]),
    ("k-zero", dumped(**{"eval.llama_cpp.speculative_tokens": [0]}), [], ["each K must be >= 1"]),
    ("zero-stage-4", dumped(**{"training.deepspeed": {"zero_stage": 4}}), [], ["training.deepspeed.zero_stage"]),
    ("name-with-slash", dumped(name="a/b"), [], ["name must be a non-empty string without '/'"]),
    ("name-empty", dumped(name=""), [], ["name must be a non-empty string"]),
    ("name-dot-dot", dumped(name="..", output_dir=None), [], ["not '.' or '..'"]),
    ("name-dot", dumped(name="."), [], ["not '.' or '..'"]),
    ("moved-key", dumped(**{"eval.cpu_packed_weights": False}), [], ["moved to target.cpu_packed_weights"]),
    ("mix-missing-file", dumped(**{"data.mix": "nowhere.yaml"}), [], ["data.mix: file 'nowhere.yaml' not found"]),
    ("mix-a-directory", dumped(**{"data.mix": "."}), [], ["data.mix:", "is not a file"]),
    ("duplicate-top-key", text("data: {{mix: {mix}}}\nseed: 1\nseed: 2\n"), [], ["key 'seed' is written twice"]),
    (
        "duplicate-section",
        text("training: {{epochs: 2}}\ndata: {{mix: {mix}}}\ntraining: {{batch_size: 2}}\n"),
        [],
        ["key 'training' is written twice (first on line 3)", ":5:"],
    ),
    ("duplicate-nested-key", text("data:\n  mix: {mix}\n  mix: {mix}\n"), [], ["key 'mix' is written twice"]),
    ("alias-bomb", text(BOMB), [], ["aliases expand to more than"]),
    ("yaml-syntax", text("data: {{mix: {mix}\n"), [], ["not valid YAML"]),
    ("yaml-tab-indent", text("data:\n\tmix: {mix}\n"), [], ["not valid YAML"]),
    ("yaml-python-tag", text("data: !!python/object/apply:os.system ['true']\n"), [], ["not valid YAML"]),
    ("yaml-deep-nesting", text("x: " + "[" * 20000 + "]" * 20000 + "\n"), [], ["recipe.yaml"]),
    ("recipe-a-list", lambda tmp: "- 1\n- 2\n", [], ["must be a YAML mapping, got list"]),
    ("recipe-a-scalar", lambda tmp: "hello\n", [], ["must be a YAML mapping, got str"]),
    ("recipe-empty", lambda tmp: "", [], ["must be a YAML mapping, got NoneType"]),
    ("recipe-binary", lambda tmp: b"\x00\x01\xff\xfe garbage", [], ["recipe.yaml:1:", "not valid UTF-8"]),
    ("recipe-invalid-utf8", lambda tmp: b"name: t\ndata: {mix: caf\xe9}\n", [], ["recipe.yaml:2:", "not valid UTF-8"]),
    ("set-unclosed-list", dumped(), ["--set", "x=[1"], ["--set 'x=[1'", "not valid YAML"]),
    ("set-no-equals", dumped(), ["--set", "training.epochs"], ["expected KEY=VALUE"]),
    ("set-empty-key", dumped(), ["--set", "=3"], ["expected KEY=VALUE"]),
    ("set-unknown-key", dumped(), ["--set", "training.epoch=2"], ["training.epoch: unknown key"]),
    ("huge-integer", text("seed: " + "9" * 5000 + "\ndata: {{mix: {mix}}}\n"), [], [":3:7:", "an integer of 5,000"]),
    (
        "set-huge-integer",
        dumped(),
        ["--set", "seed=" + "9" * 5000],
        ["--set 'seed=999", "(5,005 characters)", "an integer of 5,000 characters is too long"],
    ),
    ("eval-no-suites", dumped(**{"eval.suites": []}), [], ["eval.suites", "at least 1 item"]),
    ("vllm-no-ks", dumped(**{"eval.vllm.speculative_tokens": []}), [], ["eval.vllm.speculative_tokens"]),
    ("set-through-scalar", dumped(), ["--set", "name.x=1"], ["override name.x: name is not a section"]),
    ("set-bool-batch", dumped(), ["--set", "training.batch_size=yes"], ["training.batch_size", "valid integer"]),
    (
        "set-alias-bomb",
        dumped(),
        ["--set", "x={" + ", ".join(BOMB.splitlines()[:-1]) + "}"],
        ["--set 'x={a: &a", "aliases expand to more than"],
    ),
]


@pytest.mark.parametrize(("maker", "extra", "needles"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_recipe_is_one_line_naming_the_key(tmp_path, capsys, maker, extra, needles):
    content = maker(tmp_path)
    path = tmp_path / "recipe.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    started = time.perf_counter()
    clean_error(["data", path, *extra], capsys, *needles)
    assert time.perf_counter() - started < 10, "refusing a recipe must not take long (alias bombs, deep nesting)"


def test_the_recipe_path_itself(tmp_path, capsys):
    clean_error(["data", tmp_path / "none.yaml"], capsys, "recipe", "none.yaml not found")
    clean_error(["data", tmp_path], capsys, "is not a file")


@pytest.mark.parametrize("where", ["file", "parent-file"])
def test_output_dir_that_is_a_file(tmp_path, capsys, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    output = blocker if where == "file" else blocker / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(dumped(output_dir=str(output))(tmp_path))
    clean_error(["data", recipe], capsys, f"output_dir '{output}'", f"{blocker} is a file")


def test_a_recipe_with_a_byte_order_mark_loads(tmp_path, capsys):
    from tests.faults import run_cli

    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(b"\xef\xbb\xbf" + dumped()(tmp_path).encode())
    code, err = run_cli(["data", recipe], capsys)
    assert code == 0, err
