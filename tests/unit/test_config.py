"""``rampart.config``: settings read from the environment, checked, and the default CPU threads per model."""

from __future__ import annotations

import pydantic
import pytest

from rampart.config import Settings


def test_settings_from_env_validates_and_names_bad_values():
    settings = Settings.from_env({"RAMPART_MAX_PIXELS": "1000", "RAMPART_ALPHA_BACKGROUND": "0,0,0"})
    assert settings.inputs.max_pixels == 1000 and settings.inputs.alpha_background == (0, 0, 0)
    with pytest.raises(pydantic.ValidationError, match="max_pixels"):
        Settings.from_env({"RAMPART_MAX_PIXELS": "-1"})
    with pytest.raises(pydantic.ValidationError):
        Settings.from_env({"RAMPART_DEFAULT_DEADLINE_MS": "90000", "RAMPART_MAX_DEADLINE_MS": "1000"})


def test_default_cpu_threads_rule():
    """The rule of rampart.config.default_cpu_threads: a 2-core CPU host gives each model one
    thread; a big CPU host gives most cores to the primary and keeps one free; a GPU host feeds
    the primary with one thread and lets the fallback take half the cores."""
    from rampart.config import default_cpu_threads

    assert (default_cpu_threads("primary", 2, gpu=False), default_cpu_threads("fallback", 2, gpu=False)) == (1, 1)
    assert (default_cpu_threads("primary", 16, gpu=False), default_cpu_threads("fallback", 16, gpu=False)) == (11, 4)
    assert (default_cpu_threads("primary", 16, gpu=True), default_cpu_threads("fallback", 16, gpu=True)) == (1, 8)
    assert default_cpu_threads("primary", 1, gpu=False) == default_cpu_threads("fallback", 1, gpu=False) == 1
