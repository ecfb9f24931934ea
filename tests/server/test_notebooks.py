"""The notebooks run end to end against a real server, so they cannot rot."""

from __future__ import annotations

import os

import nbformat
from nbclient import NotebookClient

from tests.support import ROOT


def test_quickstart_notebook_runs(server, monkeypatch):
    monkeypatch.setenv("RAMPART_URL", server.url)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    NotebookClient(notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    printed = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "chelsea" in printed and "espresso" in printed
    assert os.environ["RAMPART_URL"] == server.url


def test_tuning_notebook_runs(monkeypatch):
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend, so the plot is an output
    notebook = nbformat.read(ROOT / "notebooks" / "tuning.ipynb", as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    printed = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert printed.count("knee:") == 2 and "max_latency_ms=200" in printed
    images = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, "the ramp plot was not drawn"
