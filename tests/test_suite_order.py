"""The suite's own scheduling (tests/conftest.py): ``make test`` hands xdist the files in the
collection's order, and the collection puts the slowest files first. A renamed or removed file
left in ``SLOW_FILES_FIRST`` would quietly lose its place; xdist's reordering (most tests first)
would quietly undo the whole order."""

from __future__ import annotations

from pathlib import Path

import pytest

import conftest

ROOT = Path(__file__).resolve().parents[1]


def test_every_file_put_first_exists_once() -> None:
    names = conftest.SLOW_FILES_FIRST
    assert len(set(names)) == len(names), names
    assert [n for n in names if not (ROOT / n).is_file()] == []


def test_make_test_keeps_the_collections_order() -> None:
    recipe = (ROOT / "Makefile").read_text().split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "--dist loadfile" in recipe and "--no-loadscope-reorder" in recipe, recipe


def test_the_slow_files_come_first_in_their_order(request: pytest.FixtureRequest) -> None:
    seen: list[str] = []
    for item in request.session.items:
        path = item.nodeid.split("::", 1)[0]
        if not seen or seen[-1] != path:
            seen.append(path)
    ran = [n for n in conftest.SLOW_FILES_FIRST if n in seen]  # a run of a few files holds a few
    assert seen[: len(ran)] == ran, seen[: len(ran) + 3]
