"""One pinned short loss curve per family (torchtune's recipe tests): six optimizer steps of the real trainer on the
session's stored states of the target's own replies, each loss equal to the value pinned in `loss_curves.json`.

What only this proves: that the numbers a run produces did not move. Every other training test asserts a property
(a loss falls, two ranks agree with one, a resumed run matches its uninterrupted twin), and a drift that moves every
run together (an initialisation, a loss normalisation, a mask, a learning-rate schedule, a data order) keeps each of
those true. The tolerance (relative 2e-3) is far above the float rounding that differs between instruction sets and
far below what any such change does to a loss after a step. After a deliberate change, rewrite the file with
SPECULATORS_TRAIN_PIN_LOSSES=1 and say why in the commit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from speculators_train import families
from speculators_train.recipe import load_recipe
from speculators_train.training.trainer import Trainer
from tests.conftest import FIT_SETTINGS, OWN_REPLIES, SMALL, losses, run_recipe

PINNED = Path(__file__).with_name("loss_curves.json")
REWRITE = os.environ.get("SPECULATORS_TRAIN_PIN_LOSSES") == "1"


@pytest.mark.parametrize("family", families.FAMILIES)
def test_a_short_run_of_each_family_gives_its_pinned_losses(tmp_path, own_states, family):
    # A gentle rate: a curve that jumps amplifies rounding, and a pin must hold across instruction sets.
    training = {"epochs": 2, "batch_size": 4, "learning_rate": min(SMALL[family].learning_rate, 1e-3)}
    recipe = load_recipe(
        run_recipe(
            tmp_path, own_states, training=training, draft={"family": family, **FIT_SETTINGS[family]}, data=OWN_REPLIES
        )
    )
    Trainer(recipe).train()
    got = [round(loss, 6) for _, loss in sorted(losses(tmp_path / "run").items())]
    pinned = json.loads(PINNED.read_text()) if PINNED.is_file() else {}
    if REWRITE:
        PINNED.write_text(json.dumps({**pinned, family: got}, indent=1, sort_keys=True) + "\n")
        pytest.skip("pinned values rewritten")
    assert family in pinned, f"no pinned curve for {family}: run with SPECULATORS_TRAIN_PIN_LOSSES=1"
    assert len(got) == len(pinned[family]) >= 6
    assert got == pytest.approx(pinned[family], rel=2e-3)
