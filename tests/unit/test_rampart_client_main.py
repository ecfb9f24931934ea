"""``rampart_client.__main__`` and ``bench.loadgen``'s command line, those of docs/clients.md: the SDK's
(``rampart-client`` / ``python -m rampart_client``) and ``python -m bench.loadgen``: their help, names and defaults."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from bench import loadgen
from rampart_client.__main__ import PROG, parser
from tests.support import ROOT


def subcommands(top: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (choices,) = [action.choices for action in top._actions if isinstance(action, argparse._SubParsersAction)]
    return dict(choices)


def assert_documented(command: argparse.ArgumentParser, prog: str) -> None:
    """Every option of ``command`` has help, its usage names ``prog``, and each default is shown."""
    for action in command._actions:
        assert action.help and action.help.strip(), f"{prog} {action.dest} has no help"
    text = command.format_help()
    assert text.startswith(f"usage: {prog}"), text
    for action in command._actions:
        if action.option_strings and action.default is not argparse.SUPPRESS and action.dest != "help":
            assert f"(default: {action.default})" in " ".join(text.split()), (prog, action.dest)


def test_every_option_has_help_and_its_default_is_shown():
    top = parser()
    for name, command in {"": top, **subcommands(top)}.items():
        assert_documented(command, f"{PROG} {name}".strip())
    assert_documented(loadgen.parser(), "python -m bench.loadgen")


def test_python_dash_m_prints_the_installed_command_s_name_and_the_json_option():
    out = subprocess.run([sys.executable, "-m", "rampart_client", "classify", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: rampart-client classify") and "--json" in out.stdout
    assert "(default: 5)" in out.stdout and "(default: http://127.0.0.1:3000)" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "rampart_client", "classify"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "usage: rampart-client classify" in bad.stderr


def test_python_dash_m_bench_loadgen_help_prints_its_options():
    out = subprocess.run([sys.executable, "-m", "bench.loadgen", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m bench.loadgen"), out.stderr
    assert "--connections" in out.stdout and "(default: closed)" in out.stdout


def test_the_cli_and_the_sdk_know_the_three_priority_classes():
    import rampart_client
    from rampart.overload.admission import PRIORITIES
    from rampart_client.__main__ import parser

    assert rampart_client.PRIORITIES == PRIORITIES  # the SDK's list is the server's
    assert parser().parse_args(["classify", "x.jpg", "--priority", "low"]).priority == "low"


@pytest.mark.parametrize("timeout", ["-1", "0", "nan", "inf", "soon"])
def test_a_timeout_that_is_not_a_positive_number_is_a_usage_error(timeout, capsys):
    """``--timeout -1`` ended in httpx's ``ValueError`` traceback (exit 1)."""
    with pytest.raises(SystemExit) as exited:
        parser().parse_args(["classify", "cat.jpg", "--timeout", timeout])
    assert exited.value.code == 2 and "--timeout" in capsys.readouterr().err


@pytest.mark.parametrize("timeout, deadline_ms, warned", [("1", "5000", True), ("30", "5000", False), ("1", None, False)])
def test_a_timeout_shorter_than_the_deadline_is_warned_of(timeout, deadline_ms, warned, capsys, tmp_path):
    """With ``--timeout`` under ``--deadline-ms`` the client gives up before the server's answer at the deadline (a
    degraded answer or a clear 429) can come; it ran without a word. Nothing listens at the URL: exit 1 either way."""
    import socket

    from rampart_client.__main__ import main

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    image = tmp_path / "cat.jpg"
    image.write_bytes(b"not sent")
    argv = ["classify", str(image), "--url", url, "--timeout", timeout] + (["--deadline-ms", deadline_ms] if deadline_ms else [])
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert ("warning: --timeout" in err) == warned, err
    assert "connection_failed" in err  # and the failure is named as what it is


def test_a_bad_url_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        parser().parse_args(["classify", "cat.jpg", "--url", "http://127.0.0.1:3917?x=1"])
    assert exited.value.code == 2 and "no query" in capsys.readouterr().err
