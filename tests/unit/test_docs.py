"""The docs' lists of what the registry holds: docs/architecture.md's families and the architectures they share, and
the places outside its folder a family touches, counted as docs/families.md lists them."""

import re

from speculators_train.families import FAMILIES
from tests.conftest import REPO

ARCHITECTURE = REPO / "docs" / "architecture.md"
FAMILIES_DOC = REPO / "docs" / "families.md"
FAMILY_FOLDERS = REPO / "speculators_train" / "families"
WORDS = ["five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen"]
NUMBERS = {word: n for n, word in enumerate(WORDS, start=5)}


def _marked(text: str, name: str) -> str:
    """The text between `<!-- name:start -->` and `<!-- name:end -->`."""
    return text.split(f"<!-- {name}:start -->", 1)[1].split(f"<!-- {name}:end -->", 1)[0]


def _section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_architecture_lists_every_registered_family_in_the_registrys_order():
    listed = re.findall(r"^- `(\w+)`:", _marked(ARCHITECTURE.read_text(), "families"), re.MULTILINE)
    assert listed == list(FAMILIES), "docs/architecture.md's list of families is not the registry (FAMILIES)"


def test_architecture_describes_every_shared_architecture_folder():
    """A package under families/ that is not a registered family is an architecture families share (`eagle/`,
    `block/`): the Draft families section gives it an entry of its own."""
    section = _section(ARCHITECTURE.read_text(), "Draft families")
    shared = sorted(
        p.name for p in FAMILY_FOLDERS.iterdir() if (p / "__init__.py").is_file() and p.name not in FAMILIES
    )
    assert {"eagle", "block"} <= set(shared)
    missing = [name for name in shared if f"- `{name}/`" not in section]
    assert not missing, f"docs/architecture.md does not describe families/{missing}"


def test_the_docs_give_the_number_of_places_a_family_touches_as_families_md_lists_them():
    places = re.findall(r"^- ", _marked(FAMILIES_DOC.read_text(), "places"), re.MULTILINE)
    for doc in (ARCHITECTURE, FAMILIES_DOC):
        said = re.search(r"a family (?:then )?touches (\w+) places", " ".join(doc.read_text().split()))
        assert said is not None, f"{doc.name} does not say how many places a family touches"
        assert NUMBERS.get(said[1]) == len(places), (doc.name, said[1], len(places))


def test_every_accelerate_launch_the_docs_and_recipes_show_is_quiet():
    """Without `--quiet`, accelerate's launcher follows a clean `error:` line with its own traceback of the child's
    exit status (tests/e2e/test_train_faults.py runs the quiet launch)."""
    shown = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "recipes").glob("*.yaml")]
    shown += [*(REPO / "launch").glob("*.yaml")]
    commands = [(p.name, line) for p in shown for line in p.read_text().splitlines() if "accelerate launch -" in line]
    assert len(commands) >= 10
    assert [c for c in commands if "accelerate launch --quiet " not in c[1]] == []
