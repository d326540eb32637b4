"""docs/claims.md names, for every claim, the tests that fail when it breaks: every named
test exists, ids are unique, and each mutant of tests/mutants.py names a claim of the map and
only tests the map lists under that claim."""

from __future__ import annotations

import re
from pathlib import Path

from tests.mutants import MUTANTS, markdown

ROOT = Path(__file__).resolve().parents[2]
#: A claim starts with its id in bold; the tests listed under it, one per line, follow.
CLAIM = re.compile(r"^\*\*(G\d+\.\d+)\*\* ")
TEST_LINE = re.compile(r"^- (.+)$")
NAMED = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def claim_map() -> dict[str, list[tuple[str, str]]]:
    """Claim id -> the (file, test name) pairs it names."""
    claims: dict[str, list[tuple[str, str]]] = {}
    listed: dict[str, list[str]] = {}
    current = None
    for line in (ROOT / "docs" / "claims.md").read_text().splitlines():
        if line.startswith("#"):
            current = None
        elif claim := CLAIM.match(line):
            current = claim[1]
            assert current not in listed, f"claim {current} listed twice"
            listed[current] = []
        elif current is not None and (item := TEST_LINE.match(line)):
            listed[current].append(item[1])
    for claim_id, items in listed.items():
        tests = [test for item in items for test in NAMED.findall(item)]
        untested = bool(items) and items[0].startswith("UNTESTED")
        assert tests or untested, f"{claim_id}: no test and not UNTESTED"
        claims[claim_id] = tests
    return claims


def test_every_claim_is_written_as_the_map_reads_it() -> None:
    """Each bold claim id names its claim, where it is stated, and a list of tests (or
    UNTESTED): a claim whose list the parser misses would vouch for nothing."""
    text = (ROOT / "docs" / "claims.md").read_text()
    blocks = re.split(r"\n(?=\*\*G\d+\.\d+\*\* )", text)[1:]
    assert len(blocks) == len(claim_map())
    for block in blocks:
        assert "\nStated in: " in block, block[:80]
        assert re.search(r"^- ", block, re.MULTILINE), block[:80]


def test_the_map_lists_claims_of_every_part_of_the_guarantees() -> None:
    claims = claim_map()
    assert len(claims) >= 60
    assert {claim.split(".")[0] for claim in claims} == {f"G{n}" for n in range(1, 13)}


def test_every_test_the_map_names_exists() -> None:
    missing = []
    for claim, tests in claim_map().items():
        for path, name in tests:
            source = ROOT / path
            if not source.exists() or not re.search(
                rf"^(async )?def {name}\(", source.read_text(), re.MULTILINE
            ):
                missing.append(f"{claim}: {path}::{name}")
    assert not missing, missing


def test_every_mutant_runs_tests_the_map_lists_under_its_claim() -> None:
    claims = claim_map()
    for mutant in MUTANTS:
        assert mutant.claim in claims, mutant.name
        listed = {f"{path}::{name}" for path, name in claims[mutant.claim]}
        for node in mutant.tests:
            assert node.split("[")[0] in listed, (mutant.name, node)


def test_the_mutants_page_shows_a_full_run_of_every_mutant() -> None:
    text = (ROOT / "docs" / "mutants.md").read_text()
    shown = re.findall(r"^\| `([\w-]+)` \| (G[\d.]+) \| (yes|\*\*no\*\*) \|", text, re.MULTILINE)
    assert {name for name, _, _ in shown} == {mutant.name for mutant in MUTANTS}
    assert [name for name, _, killed in shown if killed != "yes"] == [], "survivors"


def test_the_mutants_page_says_what_each_breaks_as_the_code_does() -> None:
    """Its table is ``python -m tests.mutants --markdown`` as it is: one row per mutant."""
    text = (ROOT / "docs" / "mutants.md").read_text()
    assert markdown(MUTANTS) in text
