"""Acceptance by the class of the target's next token: which step is classed how, and when a class is named."""

from speculators_train.doctor.classes import acceptance_by_class, check_classes, token_class
from speculators_train.verify.decoder import Generation

TEXT = {1: "Hello", 2: " ", 3: "42", 4: "();", 5: "world", 6: "<oov>"}


def test_each_token_falls_in_the_first_class_that_fits():
    assert token_class("Hello", first=True, inside=False) == "first token of a reply"
    assert token_class("Hello", first=False, inside=False) == "outside the draft vocabulary"
    assert token_class("\n\n", first=False, inside=True) == "whitespace"
    assert token_class(" 3.5", first=False, inside=True) == "digits"
    assert token_class(" ();", first=False, inside=True) == "code symbols"
    assert token_class(" def", first=False, inside=True) == "words"


def test_each_verify_step_is_classed_by_the_token_at_its_first_position():
    # steps: at 0 ("Hello", first) 1 accepted; at 2 ("42") 0; at 3 ("();") 2 accepted; at 6 ("<oov>") 0; at 7 (cut)
    g = Generation(tokens=[1, 2, 3, 4, 5, 1, 6], accepted=[1, 0, 2, 0, 3])
    counts = acceptance_by_class([g], TEXT.__getitem__, lambda t: t != 6)
    assert counts == {
        "first token of a reply": (1, 1),
        "outside the draft vocabulary": (0, 1),
        "digits": (0, 1),
        "code symbols": (1, 1),
    }


def test_a_class_well_below_the_overall_rate_is_named_once_it_has_enough_steps():
    counts = {"words": (60, 100), "digits": (2, 20), "whitespace": (1, 5)}
    check = check_classes(counts, "s")
    assert check.status == "warn" and check.fix.startswith("digits:") and "whitespace" not in check.fix
    assert "overall 50% of 125 steps" in check.detail and "digits 2/20 (10%)" in check.detail
    assert check_classes({"words": (60, 100), "digits": (8, 20)}, "s").status == "pass"
