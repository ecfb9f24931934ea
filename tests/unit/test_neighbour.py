"""``bench.neighbour``: its neighbour loads are valid programs that pin themselves, and the timing counts batches."""

from __future__ import annotations

import ast
import time

from bench import neighbour


def test_every_neighbour_load_is_a_python_program_pinned_to_the_neighbour_cpu_except_idle():
    assert neighbour.NEIGHBOURS["idle"] is None
    for name, code in neighbour.NEIGHBOURS.items():
        if code is None:
            continue
        ast.parse(code, filename=name)  # raises SyntaxError on a broken load
        assert code.startswith(f"import os; os.sched_setaffinity(0, {{{neighbour.NEIGHBOUR_CPU}}})"), name
        assert "while True:" in code, name  # runs until killed


def test_per_image_ms_divides_each_batch_by_its_images_and_counts_the_batches():
    def forward() -> None:
        time.sleep(0.02)

    figures = neighbour.per_image_ms(forward, 0.2)
    assert 4 <= figures["batches"] <= 10
    assert 0.02e3 / neighbour.BATCH <= figures["wall_ms"] < 0.1e3 / neighbour.BATCH
    assert figures["cpu_ms"] < figures["wall_ms"]  # sleeping spends no CPU
