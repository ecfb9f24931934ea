"""``rampart.overload.admission`` with several API workers (setting ``api_workers``, checked by ``rampart.config``;
``/readyz`` through ``rampart.api.lifecycle``): how admission divides one runner between them, in-process.

Each API worker process has its own gates; together they must admit no more than one
worker admitting everything would (docs/overload.md: several API workers).
"""

from __future__ import annotations

import pydantic
import pytest

from rampart.config import Settings
from rampart.overload.admission import AdmissionGate, ThroughputMeter

#: The primary's defaults: batches of 16, one computing and one forming, 200 ms of queue.
BATCH, BATCHES, DELAY_MS = 16, 1, 200


def worker_gates(workers: int, clock=None) -> list[AdmissionGate]:
    """One primary gate per API worker, as ``rampart.pipeline.Pipeline`` builds them."""
    meter = (lambda: ThroughputMeter(tau_s=5.0, share=1 / workers, clock=clock)) if clock else \
        (lambda: ThroughputMeter(tau_s=5.0, share=1 / workers))
    return [AdmissionGate("m", BATCH, BATCHES, DELAY_MS, meter(), workers) for _ in range(workers)]


@pytest.mark.parametrize("workers", [1, 2, 3, 5, 16])
def test_the_workers_windows_and_batch_shares_add_up_to_at_most_the_runners(workers):
    gates = worker_gates(workers)
    runner_window = (BATCHES + 1) * BATCH
    assert sum(g.window for g in gates) <= runner_window
    assert sum(g.batch_share for g in gates) <= BATCH
    assert all(g.window >= 1 and g.batch_share >= 1 for g in gates)
    if runner_window % workers == 0:
        assert sum(g.window for g in gates) == runner_window  # nothing lost when it divides evenly
    for gate in gates:
        gate.meter.seed(10.0)  # the runner's warm-up: 10 ms per image at full batch, 100 images/s
        assert gate.meter.ips == pytest.approx(100.0 / workers)
        assert gate.meter.floor_ips == pytest.approx(10.0 / workers)


def test_a_fixed_throughput_is_the_whole_models_and_each_worker_gets_its_share():
    gates = [AdmissionGate("m", BATCH, BATCHES, DELAY_MS, ThroughputMeter(override_ips=200, share=0.5), 2)
             for _ in range(2)]
    assert [g.meter.ips for g in gates] == [100.0, 100.0]
    assert sum(g.queue_limit for g in gates) == 40  # the seed's rule for the whole model: 200 img/s x 0.2 s


def test_two_busy_workers_each_measure_half_and_together_admit_what_one_would():
    """Both workers keep the runner busy (C = 80 images/s, served in turn): each meter measures its own
    completions over its own busy time, about C/2, so the two queues hold what one worker's would and
    each one's prediction for its last place matches the runner's time for everything both hold."""
    now = [0.0]
    c_ips = 80.0
    two = worker_gates(2, clock=lambda: now[0])
    one = worker_gates(1, clock=lambda: now[0])[0]
    for gate in (*two, one):
        gate.meter.seed(1000.0 / 120.0)  # warm-up said 120 images/s: the measurement must take over
        gate.meter.busy(True)
    for step in range(int(30 * c_ips)):  # 30 s of busy time
        now[0] += 1.0 / c_ips
        two[step % 2].meter.completed()  # the runner answers the two workers in turn
        one.meter.completed()
    assert [g.meter.ips for g in two] == [pytest.approx(c_ips / 2, rel=0.02)] * 2
    assert one.meter.ips == pytest.approx(c_ips, rel=0.02)
    held_by_two = sum(g.window + g.queue_limit for g in two)
    held_by_one = one.window + one.queue_limit
    assert held_by_two <= held_by_one  # together no more than one worker alone (floor rounding may keep one less)
    assert held_by_one - held_by_two <= 2
    # The last place of a full worker: the runner has both workers' images ahead of it.
    runner_s = held_by_two / c_ips
    for gate in two:
        assert gate.completion_s(gate.window + gate.queue_limit) == pytest.approx(runner_s, rel=0.1)
        assert gate.completion_s(gate.window + gate.queue_limit) >= 0.95 * runner_s  # never optimistic


def test_a_worker_alone_measures_the_whole_model():
    """While only one worker has requests, its meter earns the full speed (nothing is shared then); its
    window stays its share, so it cannot crowd out the other worker when that one gets requests again."""
    now = [0.0]
    lone, idle = worker_gates(2, clock=lambda: now[0])
    for gate in (lone, idle):
        gate.meter.seed(1000.0 / 80.0)
    lone.meter.busy(True)
    for _ in range(30 * 80):
        now[0] += 1.0 / 80
        lone.meter.completed()
    assert lone.meter.ips == pytest.approx(80.0, rel=0.02) and idle.meter.ips == pytest.approx(40.0)
    assert lone.window == idle.window == BATCH


def test_settings_refuse_more_workers_than_a_batch_has_images_and_share_the_decoders():
    assert Settings().api_workers == 1
    assert Settings(api_workers=16).api_workers == 16  # the primary's batch: 16
    with pytest.raises(pydantic.ValidationError, match="api_workers=17"):
        Settings(api_workers=17)
    assert Settings.from_env({"RAMPART_API_WORKERS": "2"}).api_workers == 2
    # decode_workers counts decoders on the host: 2 API workers share them instead of doubling them.
    assert Settings(decode_workers=2).decode_workers_per_api_worker == 2
    assert Settings(decode_workers=2, api_workers=2).decode_workers_per_api_worker == 1
    assert Settings(decode_workers=8, api_workers=3).decode_workers_per_api_worker == 2
    assert Settings(decode_workers=1, api_workers=4).decode_workers_per_api_worker == 1  # never none


#: Two entry workers, as ``bentoml serve`` starts them: children of one parent (the arbiter), each with
#: ``--service-name rampart`` in its command line. The first marks itself ready and waits; the second
#: asks before and after marking itself, and after unmarking (a drain).
_WORKER = """
import sys, time
from rampart.api.lifecycle import _ready_marks, all_entry_workers_ready, mark_worker_ready
if sys.argv[1] == "first":
    mark_worker_ready()
    time.sleep(30)
else:
    end = time.monotonic() + 20
    while not (_ready_marks().exists() and any(_ready_marks().iterdir())) and time.monotonic() < end:
        time.sleep(0.05)
    before = all_entry_workers_ready(2)
    mark_worker_ready()
    print(before, all_entry_workers_ready(2), all_entry_workers_ready(3), end=" ")
    mark_worker_ready(False)
    print(all_entry_workers_ready(2), all_entry_workers_ready(1))
"""
_ARBITER = """
import subprocess, sys
first = subprocess.Popen([sys.executable, "-c", WORKER, "first", "--service-name", "rampart"])
try:
    second = subprocess.run([sys.executable, "-c", WORKER, "second", "--service-name", "rampart"],
                            capture_output=True, text=True, timeout=60)
    print(second.stdout.strip() or second.stderr)
finally:
    first.kill()
    first.wait()
"""


def test_readyz_waits_for_every_entry_worker():
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from tests.support import ROOT

    arbiter = subprocess.Popen([sys.executable, "-c", _ARBITER.replace("WORKER", repr(_WORKER))], cwd=ROOT,
                               stdout=subprocess.PIPE, text=True)
    try:
        out, _ = arbiter.communicate(timeout=90)
    finally:
        shutil.rmtree(Path(tempfile.gettempdir()) / f"rampart-ready-{arbiter.pid}", ignore_errors=True)
    # Not ready while one of two is warm; ready when both are; not with fewer alive than expected;
    # not once one drains; one worker is never checked.
    assert out.split() == ["False", "True", "False", "False", "True"], out
