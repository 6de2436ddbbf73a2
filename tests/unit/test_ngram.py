"""The free baseline's prompt lookup: what it proposes, from which occurrence."""

import pytest

from speculators_train.proposal import Sampling
from speculators_train.verify.ngram import NgramProposer


def proposer(history: list[int]) -> NgramProposer:
    p = NgramProposer()
    p.reset(history[0])
    p.extend(history[1:], None)
    return p


def test_it_proposes_what_followed_the_most_recent_earlier_occurrence_of_the_tail():
    p = proposer([7, 1, 2, 5, 1, 2, 6, 8, 1, 2])
    assert p.propose_chain(3, Sampling(), None) == ([6, 8, 1], None)  # after the later "1 2", not the first
    assert p.propose_chain(1, Sampling(), None) == ([6], None)


def test_a_longer_match_wins_and_no_match_proposes_nothing():
    # the 3-gram "1 2 3" occurs once, followed by 9; the 2-gram "2 3" occurs later, followed by 4
    assert proposer([1, 2, 3, 9, 2, 3, 4, 1, 2, 3]).lookup(2) == [9, 2]
    assert proposer([1, 2, 3, 4]).lookup(3) == []  # nothing recurs
    assert proposer([5, 5]).lookup(3) == []  # shorter than the shortest n-gram and its continuation


def test_a_tree_is_the_lookup_as_one_chain():
    tree = proposer([1, 2, 3, 1, 2]).propose_tree(type("Spec", (), {"depth": 4})())
    assert tree.tokens == [3, 1, 2] and tree.parents == [-1, 0, 1] and tree.depths == [1, 2, 3]


def test_vllms_suffix_baseline_runs_with_its_own_settings_or_is_refused_by_name(monkeypatch, tmp_path):
    import importlib.util

    from speculators_train.engines.vllm import verify as vllm_run
    from speculators_train.errors import UserError
    from speculators_train.recipe import load_recipe
    from tests.conftest import REPO

    recipe = load_recipe(REPO / "recipes" / "eagle3.yaml", {"eval.vllm.baselines": ["ngram", "suffix"]})
    runs = {name: config for name, _, config in vllm_run.settings(recipe, None, None)}
    k = recipe.eval.num_speculative_tokens
    assert runs["suffix"] == {"method": "suffix", "num_speculative_tokens": k}  # no prompt-lookup settings
    assert runs["ngram"]["prompt_lookup_max"] == 4
    monkeypatch.setattr(vllm_run.offline, "require", lambda: None)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "arctic_inference" else real(name))
    with pytest.raises(UserError, match=r"eval\.vllm\.baselines: `suffix`.*arctic-inference"):
        vllm_run.run_vllm(recipe, [], None, tmp_path)
