"""The notebooks run end to end against a real server, from their own folder, so they cannot rot;
the quickstart exactly as docs/clients.md runs it (``jupyter nbconvert --execute``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from tests.support import ROOT

NOTEBOOKS = ROOT / "notebooks"
JUPYTER = Path(sys.executable).parent / "jupyter"


def printed(notebook) -> str:
    return "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_quickstart_notebook_runs_with_jupyter_nbconvert_from_its_folder(server, tmp_path):
    env = {**os.environ, "RAMPART_URL": server.url, "MPLBACKEND": "Agg"}
    out = subprocess.run([str(JUPYTER), "nbconvert", "--to", "notebook", "--execute", "quickstart.ipynb",
                          "--output-dir", str(tmp_path)], cwd=NOTEBOOKS, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = printed(nbformat.read(tmp_path / "quickstart.ipynb", as_version=4))
    assert "chelsea" in text and "espresso" in text


def test_tuning_notebook_concludes_from_the_numbers_it_measured(monkeypatch):
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend, so the plot is an output
    notebook = nbformat.read(NOTEBOOKS / "tuning.ipynb", as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell("import json; print('RESULTS=' + json.dumps(results))"))
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    text = printed(notebook)
    assert text.count("knee:") == 2 and "max_latency_ms=200" in text
    images = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, "the ramp plot was not drawn"
    results = json.loads(text.split("RESULTS=")[1])
    (name_a, a), (name_b, b) = ((name, result["steps"][-1]) for name, result in results.items())
    # The conclusion names, for the highest load, what this run measured, not a sentence written beforehand.
    for name, step in ((name_a, a), (name_b, b)):
        assert (f"{name}: {step['throughput_rps']} answers/s at P99 {step['p99_ms']} ms, "
                f"{step['degraded_rate']:.0%} of requests degraded, {step['full_rps']} full answers/s") in text
    more_full = name_a if a["full_rps"] > b["full_rps"] else name_b
    lower_p99 = name_a if a["p99_ms"] < b["p99_ms"] else name_b
    assert f"More full answers: {more_full}." in text and f"Lower P99: {lower_p99}." in text
    assert "Recommendation from this run: " in text
