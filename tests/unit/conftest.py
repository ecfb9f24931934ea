"""Fixtures of the in-process tests: the stand-in app (``tests.unit.standins.Rig``)."""

from __future__ import annotations

import pytest

from tests.unit.standins import Rig, close_rig, open_rig


@pytest.fixture
def make_rig():
    """``make_rig(ready=True, **settings)``: a ready app with stand-in models (``open_rig``), closed after the test."""
    made: list[Rig] = []

    def make(ready: bool = True, **overrides) -> Rig:
        made.append(open_rig(ready, **overrides))
        return made[-1]

    yield make
    for rig in made:
        close_rig(rig)


@pytest.fixture
def rig(make_rig) -> Rig:
    """A ready app with stand-in models and default settings."""
    return make_rig()
