"""README's quickstart, run as written against a real server: its ``curl`` lines (``/readyz``, then
``/classify`` with the bundled photo) and its three SDK lines, taken out of README itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tests.support import PHOTOS, ROOT

README = (ROOT / "README.md").read_text()


def quickstart_blocks() -> tuple[list[str], str]:
    """The quickstart's shell lines and its Python block, from README's first screen."""
    section = README[README.index("### Quickstart"):README.index("\n## ")]
    (shell,) = re.findall(r"```sh\n(.*?)```", section, re.DOTALL)
    (python,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    return [line.split("   #")[0].strip() for line in shell.splitlines()], python


def test_the_quickstart_is_on_the_first_screen_after_make_serve_and_make_test():
    first_screen = README.splitlines()[:45]
    assert any(line.startswith("make serve") for line in first_screen[:8])
    assert any(line.startswith("make test") for line in first_screen[:8])
    assert "### Quickstart: from a clone to a label" in first_screen
    assert (ROOT / "docs" / "samples" / "cat.jpg").stat().st_size < 100_000


def test_readme_curl_lines_and_sdk_lines_give_the_cat_its_label(server):
    shell, python = quickstart_blocks()
    env = {**os.environ, "PORT": str(server.port)}
    readyz = [line for line in shell if "/readyz" in line and line.startswith("curl")]
    classify = [line for line in shell if "/classify" in line and line.startswith("curl")]
    assert len(readyz) == len(classify) == 1 and "${PORT:-3000}" in readyz[0] and "${PORT:-3000}" in classify[0], shell
    ready = subprocess.run(["bash", "-c", readyz[0]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert ready.returncode == 0 and ready.stdout.strip() == "200", ready
    answer = subprocess.run(["bash", "-c", classify[0]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    body = json.loads(answer.stdout)
    assert len(body["labels"]) == 3 and body["labels"][0]["index"] in PHOTOS["chelsea"], body
    assert len(python.strip().splitlines()) == 3
    sdk = subprocess.run([sys.executable, "-c", python], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert sdk.returncode == 0, sdk.stderr
    assert sdk.stdout.strip() == body["labels"][0]["label"], (sdk.stdout, body)
