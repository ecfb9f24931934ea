"""The SDK's command line (``rampart-client`` / ``python -m rampart_client``): its help, names and defaults."""

from __future__ import annotations

import argparse
import subprocess
import sys

from rampart_client.__main__ import PROG, parser
from tests.support import ROOT


def subcommands(top: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (choices,) = [action.choices for action in top._actions if isinstance(action, argparse._SubParsersAction)]
    return dict(choices)


def test_every_option_has_help_and_its_default_is_shown():
    top = parser()
    for name, command in {"": top, **subcommands(top)}.items():
        for action in command._actions:
            assert action.help and action.help.strip(), f"{name} {action.dest} has no help"
        text = command.format_help()
        assert text.startswith(f"usage: {PROG}"), text
        for action in command._actions:
            if action.option_strings and action.default is not argparse.SUPPRESS and action.dest != "help":
                assert f"(default: {action.default})" in " ".join(text.split()), (name, action.dest)


def test_python_dash_m_prints_the_installed_command_s_name_and_the_json_option():
    out = subprocess.run([sys.executable, "-m", "rampart_client", "classify", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: rampart-client classify") and "--json" in out.stdout
    assert "(default: 5)" in out.stdout and "(default: http://127.0.0.1:3000)" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "rampart_client", "classify"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "usage: rampart-client classify" in bad.stderr
