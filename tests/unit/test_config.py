"""``rampart.config``: settings read from the environment, checked, and the default CPU threads per model."""

from __future__ import annotations

import pydantic
import pytest

from rampart.config import Settings


def test_settings_from_env_validates_and_names_bad_values():
    settings = Settings.from_env({"RAMPART_MAX_PIXELS": "1000", "RAMPART_ALPHA_BACKGROUND": "0,0,0"})
    assert settings.inputs.max_pixels == 1000 and settings.inputs.alpha_background == (0, 0, 0)
    with pytest.raises(pydantic.ValidationError, match=r"RAMPART_MAX_PIXELS \(inputs\.max_pixels\)"):
        Settings.from_env({"RAMPART_MAX_PIXELS": "-1"})
    with pytest.raises(pydantic.ValidationError):
        Settings.from_env({"RAMPART_DEFAULT_DEADLINE_MS": "90000", "RAMPART_MAX_DEADLINE_MS": "1000"})


@pytest.mark.parametrize("variable, value, path", [("RAMPART_MAX_BODY_BYTES", "abc", "inputs.max_body_bytes"),
                                                   ("RAMPART_ALPHA_BACKGROUND", "0,0,256", "inputs.alpha_background"),
                                                   ("RAMPART_API_WORKERS", "0", "api_workers"),
                                                   ("RAMPART_PRIMARY_ENGINE", "tensorrt", "primary.engine"),
                                                   ("RAMPART_MAX_DEADLINE_MS", "100000000000000000",
                                                    "deadlines.max_deadline_ms")])
def test_a_bad_variable_is_named_in_the_error(variable, value, path):
    """The error names the variable the operator set, with the nested path, and the value; pydantic alone named only
    the path (``inputs.max_body_bytes``), which appears nowhere in the operator's environment."""
    with pytest.raises(pydantic.ValidationError) as refused:
        Settings.from_env({variable: value})
    assert f"{variable} ({path})" in str(refused.value) and value.split(",")[-1] in str(refused.value)
    assert len(refused.value.errors()) == 1


def test_default_cpu_threads_rule():
    """The rule of rampart.config.default_cpu_threads. Under the default placement ("weight") the primary of a
    CPU host gets a thread per core; under "reserve" and "off" a 2-core CPU host gives each model one thread
    and a big CPU host gives most cores to the primary and keeps one free. The fallback gets a quarter of the
    cores under every placement; a GPU host feeds the primary with one thread and lets the fallback take half."""
    from rampart.config import default_cpu_threads

    for placement in ("reserve", "off"):
        assert (default_cpu_threads("primary", 2, False, placement), default_cpu_threads("fallback", 2, False, placement)) == (1, 1)
        assert (default_cpu_threads("primary", 16, False, placement),
                default_cpu_threads("fallback", 16, False, placement)) == (11, 4)
    assert (default_cpu_threads("primary", 2, gpu=False), default_cpu_threads("fallback", 2, gpu=False)) == (2, 1)
    assert (default_cpu_threads("primary", 16, gpu=False), default_cpu_threads("fallback", 16, gpu=False)) == (16, 4)
    for placement in ("weight", "reserve", "off"):
        assert (default_cpu_threads("primary", 16, True, placement), default_cpu_threads("fallback", 16, True, placement)) == (1, 8)
        assert default_cpu_threads("primary", 1, False, placement) == default_cpu_threads("fallback", 1, False, placement) == 1


def test_the_runners_engines_get_their_threads_from_the_placement_setting():
    """``runners.common.engine_cpu_threads`` follows ``RAMPART_CPU_PINNING`` for an unset thread count."""
    from rampart.config import Settings
    from rampart.cores import available_cores
    from runners.common import engine_cpu_threads, runner_spec

    cores = available_cores()
    weight, reserve = (runner_spec(Settings.from_env({"RAMPART_CPU_PINNING": value}), "primary")
                       for value in ("weight", "reserve"))
    assert (weight.placement, reserve.placement) == ("weight", "reserve")
    assert runner_spec(Settings(), "primary").placement == "weight"  # the default
    from inference.engines import cuda_present

    if not cuda_present():
        assert engine_cpu_threads(weight) == cores
        assert engine_cpu_threads(reserve) == max(1, cores - max(1, cores // 4) - 1)
    fixed = runner_spec(Settings.from_env({"RAMPART_CPU_PINNING": "weight", "RAMPART_PRIMARY_CPU_THREADS": "3"}), "primary")
    assert engine_cpu_threads(fixed) == 3  # a thread count that is set wins


def test_every_variable_sets_its_nested_setting():
    """Each flat name's variable reaches the nested path ``FLAT_NAMES`` gives it (its default, written as text)."""
    from rampart.config import FLAT_NAMES, Settings

    defaults = Settings()
    for name in FLAT_NAMES:
        value = defaults.flat(name)
        text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        assert Settings.from_env({"RAMPART_" + name.upper(): text}).flat(name) == value, name
    settings = Settings.from_env({"RAMPART_PRIMARY_MAX_BATCH_SIZE": "7", "RAMPART_FALLBACK_RESERVE_MS": "100",
                                  "RAMPART_THROUGHPUT_TAU_MS": "900", "RAMPART_ROUTING": "cascade",
                                  "RAMPART_CASCADE_THRESHOLD": "0.5", "RAMPART_FAULT_FILE": "/tmp/f.json",
                                  "RAMPART_NOT_A_SETTING": "ignored"})
    assert (settings.primary.max_batch_size, settings.fallback.max_batch_size) == (7, 32)
    assert settings.deadlines.fallback_reserve_ms == 100 and settings.admission.throughput_tau_ms == 900
    assert (settings.routing.mode, settings.routing.threshold, settings.faults.file) == ("cascade", 0.5, "/tmp/f.json")


def test_flat_and_nested_keywords_build_the_same_settings():
    flat = Settings(primary_max_batch_size=8, fallback_nice=12, decode_oversample=2, breaker_probes=5, api_workers=2)
    nested = Settings(primary={"max_batch_size": 8}, fallback={"nice": 12}, decoding={"oversample": 2},
                      breaker={"probes": 5}, api_workers=2)
    assert flat == nested and flat.primary.model == "rampart-primary:latest" and flat.fallback.max_batch_size == 32
    assert Settings(**{**flat.model_dump(), "decode_timeout_ms": 1}).decoding.timeout_ms == 1
    assert Settings(**{**flat.model_dump(), "decode_timeout_ms": 1}).decoding.oversample == 2
    with pytest.raises(pydantic.ValidationError):
        Settings(not_a_setting=1)
    with pytest.raises(pydantic.ValidationError):
        Settings(primary_max_batch_size=1)  # at least 2, as before
    with pytest.raises(pydantic.ValidationError):
        Settings(primary_engine="tensorrt")


def test_the_documented_table_is_the_generated_one():
    """docs/configuration.md embeds ``settings_table()`` unchanged (regenerate: ``python -m rampart.config --table``)."""
    import pathlib

    from rampart.config import settings_table

    doc = (pathlib.Path(__file__).parents[2] / "docs" / "configuration.md").read_text(encoding="utf-8")
    begin = doc.index("-->\n", doc.index("<!-- settings table:")) + len("-->\n")
    assert doc[begin:doc.index("<!-- end of settings table -->")] == settings_table()


def test_the_table_command_prints_the_table():
    import subprocess
    import sys

    from rampart.config import FLAT_NAMES, settings_table

    printed = subprocess.run([sys.executable, "-m", "rampart.config", "--table"], capture_output=True, text=True,
                             check=True).stdout
    assert printed == settings_table() and len(printed.splitlines()) == len(FLAT_NAMES) + 2


@pytest.mark.parametrize("variable, value", [("RAMPART_PRIMARY_MODEL", ""), ("RAMPART_FALLBACK_MODEL", " "),
                                             ("RAMPART_PRIMARY_MODEL", "rampart primary"),
                                             ("RAMPART_SHADOW_MODEL", "candidate:"),
                                             ("RAMPART_ALPHA_BACKGROUND", "300,-1,0")])
def test_an_empty_or_malformed_model_tag_and_a_colour_out_of_range_are_refused(variable, value):
    """An empty primary tag passed, and every worker then failed at start: the server restarted them without end.
    A colour channel of 300 was taken (and composited as something else)."""
    with pytest.raises(pydantic.ValidationError):
        Settings.from_env({variable: value})


@pytest.mark.parametrize("variable, value", [("RAMPART_PRIMARY_MODEL", "rampart-primary:huscvbxmdwz4cax4"),
                                             ("RAMPART_SHADOW_MODEL", ""), ("RAMPART_SHADOW_MODEL", "candidate.v2:v9"),
                                             ("RAMPART_ALPHA_BACKGROUND", "0,128,255")])
def test_well_formed_tags_and_colours_are_taken(variable, value):
    Settings.from_env({variable: value})


def test_a_variable_that_nearly_spells_a_setting_is_named_in_a_warning(caplog):
    from rampart.config import _warn_of_misspelt_variables

    environ = {"RAMPART_MAX_BODY_BYTE": "10", "RAMPART_DEFAUlT_DEADLINE_MS": "5", "RAMPART_URL": "http://x",
               "RAMPART_PYTHON": "python3", "RAMPART_MAX_BODY_BYTES": "100"}
    with caplog.at_level("WARNING", logger="rampart.config"):
        settings = Settings.from_env(environ)
    assert settings.inputs.max_body_bytes == 100 and settings.deadlines.default_deadline_ms == 1000  # typos ignored
    assert _warn_of_misspelt_variables(environ) == [
        "RAMPART_MAX_BODY_BYTE is not a setting and is ignored; did you mean RAMPART_MAX_BODY_BYTES?",
        "RAMPART_DEFAUlT_DEADLINE_MS is not a setting and is ignored; did you mean RAMPART_DEFAULT_DEADLINE_MS?"]
    assert "RAMPART_MAX_BODY_BYTE is not a setting" in caplog.text and "RAMPART_URL" not in caplog.text
