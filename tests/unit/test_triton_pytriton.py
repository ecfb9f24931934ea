"""``bench.baselines.triton_pytriton``, the Triton baseline of ``bench.load_bench``, without a server: the skip path
when PyTriton is not installed and the stub's library path. The baseline itself runs only in ``make bench-peers``
(docs/benchmarks.md)."""

from __future__ import annotations

import sys
import sysconfig

from bench.baselines import triton_pytriton


def test_triton_baseline_is_skipped_with_a_message_where_pytriton_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("RAMPART_PEERS_PYTHON", sys.executable)  # the main venv: numpy 2, no PyTriton
    reason = triton_pytriton.skip_reason()
    assert "nvidia-pytriton is not installed" in reason and "make bench-peers" in reason
    monkeypatch.setenv("RAMPART_PEERS_PYTHON", str(tmp_path / "python"))
    reason = triton_pytriton.skip_reason()
    assert "does not exist" in reason and "make bench-peers" in reason


def test_stub_library_path_puts_this_interpreters_libpython_first():
    libdir = sysconfig.get_config_var("LIBDIR")
    assert triton_pytriton.stub_library_path(None) == libdir
    assert triton_pytriton.stub_library_path("/opt/a:/opt/b") == f"{libdir}:/opt/a:/opt/b"
