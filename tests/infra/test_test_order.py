"""The suite's longest-first order (tests/conftest.py) names files that exist: a renamed or
removed file would otherwise fall silently to its collection place."""

from pathlib import Path

from tests.conftest import LONGEST_FIRST

ROOT = Path(__file__).resolve().parents[2]


def test_longest_first_names_existing_test_files():
    missing = [p for p in LONGEST_FIRST if not (ROOT / p).is_file()]
    assert not missing, missing
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
