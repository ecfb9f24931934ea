"""``rampart.inputs.pool``'s ``BoundedPool``: with decode worker processes (``processes=True``) an overrun frees its
slot at once; on threads, the priority order and the bounds on queue, start wait and run time. Also
``rampart.inputs.decode_job.prepare`` as the workers run it (the fallback's input made only when asked)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from PIL import Image

from rampart import errors
from rampart.config import Settings
from rampart.overload.deadline import Deadline
from rampart.inputs.buckets import fit_to_bucket
from rampart.inputs.decode_job import model_input, prepare
from rampart.errors import Overloaded
from rampart.pipeline import decode_pool
from rampart.inputs.pool import BoundedPool, JobTimeout, WorkerDied
from tests.support.stalls import loop_stall_s
from tests.support import encode, photo
from tests.unit.standins import stand_in_chain


@pytest.fixture(scope="module")
def pool():
    pool = BoundedPool(workers=2, queue=4, processes=True, preload=("rampart.inputs.decode_job",))
    yield pool
    pool.close()


def test_an_overrunning_job_is_killed_and_its_slot_and_worker_come_back(pool):
    async def scenario():
        with pytest.raises(JobTimeout) as overrun:
            await pool.run(time.sleep, 3600, budget_s=30, run_limit_s=0.2)
        assert overrun.value.by_run_limit
        # Both slots work again, side by side, long before the hung job could have ended.
        started = time.monotonic()
        await pool.run(time.sleep, 0.4)
        one_s = time.monotonic() - started
        started = time.monotonic()
        await asyncio.gather(*(pool.run(time.sleep, 0.4) for _ in range(2)))
        return (time.monotonic() - started) / one_s

    before = pool.replaced
    assert asyncio.run(scenario()) < 1.5  # two jobs take about as long as one: both workers run
    stats = pool.stats()
    assert pool.replaced == before + 1 and stats["alive"] == stats["configured"] == 2 and stats["pending"] == 0


def test_a_job_past_the_callers_budget_is_killed_too(pool):
    async def scenario():
        with pytest.raises(JobTimeout) as late:
            await pool.run(time.sleep, 3600, budget_s=0.2, run_limit_s=30)
        return late.value

    before = pool.replaced
    assert not asyncio.run(scenario()).by_run_limit
    _wait_for(lambda: pool.replaced == before + 1 and pool.stats()["alive"] == 2)


def test_a_worker_that_dies_is_replaced_and_the_job_raises_worker_died(pool):
    async def scenario():
        with pytest.raises(WorkerDied, match="exited with code 3"):
            await pool.run(os._exit, 3)
        return await pool.run(sum, [1, 2, 3])

    assert asyncio.run(scenario()) == 6
    assert pool.stats()["alive"] == 2


def test_decode_workers_keep_freed_heap_so_a_decode_maps_no_fresh_memory():
    """With small fixed thresholds (blocks from 128 KiB mapped, the heap trimmed past 256 KiB; glibc starts at
    128 KiB for both) a decode worker maps each decode's frames afresh (a 260×260 frame is 270 KB): page faults on
    every upload. glibc's dynamic thresholds ended there in about half of the fresh workers, depending on what
    the process had freed before. The service's decode workers keep freed heap (``decode_heap_keep_mib``, run
    in each worker process, a replaced one included)."""
    from rampart.heap import keep_freed_heap
    from tests.support.heap import faults_per_prepare

    body = encode(np.asarray(Image.fromarray(photo("chelsea")).resize((260, 260))), "PNG")
    settings = Settings(decoding={"workers": 1})
    pool = decode_pool(settings)
    plan = pool.share(stand_in_chain(settings).plan)
    try:
        kept = asyncio.run(pool.run(faults_per_prepare, body, plan, 30))
        pool._slots[0].process.replace()
        kept_after_replacement = asyncio.run(pool.run(faults_per_prepare, body, plan, 30))
        assert asyncio.run(pool.run(keep_freed_heap, 256 << 10))  # small fixed thresholds: 128 KiB mapped, 256 KiB trim
        starting = asyncio.run(pool.run(faults_per_prepare, body, plan, 30))
    finally:
        pool.close()
    assert starting >= 20  # about 90-160 on this host
    assert kept <= 1 and kept_after_replacement <= 1


def test_process_pool_keeps_priority_order_and_its_queue_bound():
    one = BoundedPool(workers=1, queue=3, processes=True)
    try:
        async def scenario():
            blocker = asyncio.create_task(one.run(time.sleep, 0.5))
            await asyncio.sleep(0.2)
            normal = [asyncio.create_task(one.run(time.monotonic)) for _ in range(2)]
            high = asyncio.create_task(one.run(time.monotonic, high=True))
            await asyncio.sleep(0.05)
            with pytest.raises(Overloaded):  # one running + three waiting = full
                await one.run(time.monotonic)
            await blocker
            return await high, await asyncio.gather(*normal)

        high_at, normal_at = asyncio.run(scenario())
        assert high_at < min(normal_at)
    finally:
        one.close()


def test_pipeline_on_processes_answers_422_decode_timeout_then_the_next_upload():
    """The decode-hang fault: 422 decode_timeout, the worker replaced, and the next upload answered."""
    settings = Settings(decode_timeout_ms=300, fault_decode_hang=True)
    slow = stand_in_chain(settings, pool=decode_pool(settings))
    try:
        data = encode(photo("chelsea"))
        with pytest.raises(errors.DecodeTimeout):
            asyncio.run(slow.classify(data, 5, Deadline(10_000)))
        slow.plan = dataclasses.replace(slow.plan, fault_hang=False)  # the fault ends
        answer = asyncio.run(slow.classify(data, 3, Deadline(10_000)))
        assert answer["labels"][0]["index"] == 1
        # The hung worker is replaced after its caller was answered (the other worker took the next upload).
        _wait_for(lambda: slow.state()["decode_workers"]["replaced"] == 1)
    finally:
        slow.pool.close()


def test_close_right_after_an_overrun_leaves_no_worker_alive():
    """close() races the replacement of a killed worker: whichever comes first, no process survives."""
    one = BoundedPool(workers=1, queue=1, processes=True, name="rampart-close-race")
    with pytest.raises(JobTimeout):
        asyncio.run(one.run(time.sleep, 3600, run_limit_s=0.1))
    one.close()  # the replacement is starting in the pool's thread, or about to
    time.sleep(0.5)  # long enough for a replacement that was not stopped to have started
    assert [p.name for p in multiprocessing.active_children() if p.name.startswith("rampart-close-race")] == []


def test_an_interpreter_that_never_closes_its_pool_still_exits():
    """The workers ignore SIGTERM (the server's drain is the parent's), so exit must kill them itself."""
    code = "from rampart.inputs.pool import BoundedPool; BoundedPool(workers=1, queue=1, processes=True); print('up')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "up")


def test_prepare_makes_only_the_primarys_input_and_the_fallbacks_when_asked():
    plan = stand_in_chain(Settings()).plan
    prepared = prepare(encode(photo("chelsea")), plan)
    shapes = lambda: {role: (bucket.name, pixels.shape, pixels.dtype.name)  # noqa: E731
                      for role, (bucket, pixels) in prepared.inputs.items()}
    assert shapes() == {"primary": ("landscape", (260, 346, 3), "uint8")}
    assert isinstance(prepared.warnings, tuple) and len(prepared.key) == 32 and prepared.declared_size == (451, 300)
    made = model_input(prepared, "fallback", plan.buckets["fallback"])
    assert shapes() == {"primary": ("landscape", (260, 346, 3), "uint8"), "fallback": ("landscape", (224, 298, 3), "uint8")}
    assert model_input(prepared, "fallback", plan.buckets["fallback"]) is made  # made once
    assert model_input(prepared, "primary", plan.buckets["primary"]) is prepared.inputs["primary"]


def test_the_fallbacks_input_from_the_primarys_array_agrees_with_a_direct_fit():
    """The fallback's input made from the primary's array sees what a direct fit of the photo sees."""
    plan = stand_in_chain(Settings()).plan
    for name in ("chelsea", "coffee", "astronaut"):
        prepared = prepare(encode(photo(name)), plan)
        bucket, derived = model_input(prepared, "fallback", plan.buckets["fallback"])
        direct = fit_to_bucket(Image.fromarray(photo(name)), bucket, plan.crop_margin)
        assert np.abs(derived.astype(float) - direct).mean() < 4.0, name  # of 255: resampling only


def test_a_shared_plan_goes_to_each_worker_once_and_again_to_a_replacement():
    pool = BoundedPool(workers=1, queue=4, processes=True, name="rampart-share")
    try:
        plan = pool.share(stand_in_chain(Settings()).plan)
        body = encode(photo("chelsea"))
        worker = pool._slots[0].process
        first = asyncio.run(pool.run(prepare, body, plan))
        assert worker.defined == {"shared-0"}
        second = asyncio.run(pool.run(prepare, body, plan))
        assert np.array_equal(first.inputs["primary"][1], second.inputs["primary"][1])
        assert first.inputs["primary"][1].shape == (260, 346, 3)
        worker.replace()  # a fresh process has no plan yet: it is sent again before its first job
        assert worker.defined == set()
        third = asyncio.run(pool.run(prepare, body, plan))
        assert worker.defined == {"shared-0"} and third.key == first.key
    finally:
        pool.close()


def _wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_pool_runs_high_priority_first_then_lower_rank_then_in_arrival_order():
    async def scenario():
        pool = BoundedPool(workers=1, queue=10)
        gate = threading.Event()
        order: list[str] = []
        blocker = asyncio.create_task(pool.run(gate.wait))
        await asyncio.sleep(0.05)
        jobs = [asyncio.create_task(pool.run(order.append, name, high=high, rank=rank))
                for name, high, rank in (("n1", False, 1), ("n0", False, 0), ("h1", True, 1), ("n1b", False, 1),
                                         ("h0", True, 0), ("n0b", False, 0))]
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(blocker, *jobs)
        return order

    assert asyncio.run(scenario()) == ["h0", "h1", "n0", "n0b", "n1", "n1b"]


def test_pool_bounds_queue_start_wait_and_run_time():
    async def scenario():
        pool = BoundedPool(workers=1, queue=1)
        gate = threading.Event()
        with pytest.raises(JobTimeout) as slow:  # started, then ran past its own limit
            await pool.run(time.sleep, 0.3, budget_s=5, run_limit_s=0.05)
        assert slow.value.by_run_limit
        with pytest.raises(JobTimeout) as late:  # started, then the caller's budget ran out
            await pool.run(time.sleep, 0.6, budget_s=0.3, run_limit_s=5)
        assert not late.value.by_run_limit
        blocker = asyncio.create_task(pool.run(time.sleep, 0.3))
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded):  # never started within its budget: cancelled, 429
            await pool.run(time.sleep, 0, budget_s=0.05)
        await blocker
        gate.clear()
        hold = asyncio.create_task(pool.run(gate.wait))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(pool.run(time.sleep, 0))
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded):  # one running + one waiting = full
            await pool.run(time.sleep, 0)
        gate.set()
        await asyncio.gather(hold, queued)
        return pool.pending

    assert asyncio.run(scenario()) == 0


def test_a_jobs_run_limit_counts_from_its_start_not_from_its_wait_in_the_queue():
    async def scenario():
        pool = BoundedPool(workers=1, queue=1)
        blocker = asyncio.create_task(pool.run(time.sleep, 0.3))
        await asyncio.sleep(0.02)
        queued_at = time.monotonic()  # waits ~0.28 s for the worker, longer than its run limit, then runs 0.05 s
        result = await pool.run(lambda: time.sleep(0.05) or "done", budget_s=2.0, run_limit_s=0.2)
        await blocker
        return result, time.monotonic() - queued_at, pool.pending

    result, waited_s, pending = asyncio.run(scenario())
    assert result == "done" and waited_s > 0.2 and pending == 0


def test_the_hand_off_carries_frames_larger_than_the_socket_buffer_and_an_end_mid_message_is_eof():
    from rampart.inputs import pool as pool_module

    left, right = socket.socketpair()
    pixels = np.arange(1600 * 1200 * 3, dtype=np.uint32).reshape(1600, 1200, 3) % 251  # 23 MB: many socket buffers
    upload = os.urandom(5 << 20)
    sender = threading.Thread(target=pool_module._send, args=(left, b"J", ("ok", (pixels, upload, "small"))))
    sender.start()
    kind, (status, (got_pixels, got_upload, small)) = pool_module._receive(right)
    sender.join()
    assert (kind, status, small) == (b"J", "ok", "small")
    assert type(got_upload) is bytes and got_upload == upload  # an upload stays bytes for the decoder
    assert got_pixels.dtype == pixels.dtype and np.array_equal(got_pixels, pixels)

    whole = bytearray()  # one whole message's bytes, as a worker would write them
    a, b = socket.socketpair()
    writer = threading.Thread(target=lambda: (pool_module._send(a, b"J", ("ok", upload)), a.close()))
    writer.start()
    while chunk := b.recv(1 << 20):
        whole += chunk
    writer.join()
    b.close()
    killed = threading.Thread(target=lambda: (left.sendall(whole[: len(whole) // 2]), left.close()))
    killed.start()  # a worker killed half-way through its answer
    with pytest.raises(EOFError):
        pool_module._receive(right)
    killed.join()
    right.close()


def test_a_callers_time_running_out_during_a_workers_replacement_never_blocks_the_event_loop(monkeypatch):
    from rampart.inputs import pool as pool_module

    monkeypatch.setattr(pool_module, "IDLE_CHECK_S", 60.0, raising=False)  # the dead worker is found by the job, as before
    one = BoundedPool(workers=1, queue=2, processes=True)
    try:
        start = pool_module._Process._start

        def slow_start(process):  # a replacement that takes 1.2 s: a forkserver starting again on a busy host
            time.sleep(1.2)
            start(process)

        monkeypatch.setattr(pool_module._Process, "_start", slow_start)
        one._slots[0].process.process.kill()  # dies while idle
        one._slots[0].process.process.join()

        async def scenario():
            began = time.monotonic()
            with pytest.raises(JobTimeout):  # its budget ends while the worker is being replaced
                await one.run(time.sleep, 0, budget_s=0.3, run_limit_s=5.0)
            return time.monotonic() - began

        answered_s, stall_s = loop_stall_s(scenario)
        assert answered_s < 0.6
        assert stall_s < 0.25, f"the event loop stalled {stall_s * 1000:.0f} ms"
        _wait_for(lambda: one.stats()["alive"] == 1 and one.pending == 0, timeout_s=10)
        assert asyncio.run(one.run(time.sleep, 0, budget_s=10, run_limit_s=10)) is None
    finally:
        one.close()


def test_a_job_whose_client_hung_up_is_still_killed_at_its_run_limit():
    from rampart import hangup

    one = BoundedPool(workers=1, queue=2, processes=True)
    try:
        async def scenario():
            async def gone_client():
                hangup._CURRENT.set(hangup.Request(gone=True))  # as serve_until_hang_up marks a closed connection
                await one.run(time.sleep, 30, budget_s=60, run_limit_s=0.5)  # a decode stuck for 30 s

            task = asyncio.create_task(gone_client())
            await asyncio.sleep(0.2)  # started
            task.cancel()  # the client's request is cancelled
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.6)  # past the run limit
            for _ in range(100):
                if one.pending == 0 and one.replaced == 1:
                    break
                await asyncio.sleep(0.05)
            return one.pending, one.replaced, await one.run(time.sleep, 0, budget_s=10, run_limit_s=10)

        assert asyncio.run(scenario()) == (0, 1, None)
    finally:
        one.close()


def test_a_worker_that_dies_while_idle_is_replaced_without_waiting_for_a_job():
    one = BoundedPool(workers=2, queue=2, processes=True)
    try:
        for slot in one._slots:
            slot.process.process.kill()
        _wait_for(lambda: one.replaced == 2 and one.stats()["alive"] == 2, timeout_s=10)
        assert asyncio.run(one.run(time.sleep, 0, budget_s=10, run_limit_s=10)) is None
    finally:
        one.close()


#: Run in a child Python (the forkserver is one per process): a pool of two, SIGTERM to its forkserver as a signal
#: to the whole process group sends it, a second's wait (the idle check runs each ``IDLE_CHECK_S``), then a job.
_SIGTERM_TO_THE_FORKSERVER = """
import asyncio, json, multiprocessing.forkserver, os, signal, time
from rampart.inputs.pool import BoundedPool, IDLE_CHECK_S

async def main():
    pool = BoundedPool(workers=2, queue=2, processes=True)
    before = {await pool.run(os.getpid) for _ in range(4)}
    forkserver = multiprocessing.forkserver._forkserver._forkserver_pid
    os.kill(forkserver, signal.SIGTERM)
    time.sleep(2 * IDLE_CHECK_S + 0.5)
    after = {await pool.run(os.getpid) for _ in range(4)}
    alive = True
    try:
        os.kill(forkserver, 0)
    except ProcessLookupError:
        alive = False
    print(json.dumps({"forkserver": forkserver, "alive": alive, "replaced": pool.replaced,
                      "same_workers": after <= before}))
    pool.close()

asyncio.run(main())
"""


def test_a_sigterm_to_the_process_group_leaves_the_forkserver_and_its_idle_workers_alone():
    """``kill -- -PGID`` on ``bentoml serve`` reaches the decode pool's forkserver too. It used to die, and the pool
    then read every idle worker's status as 255 ("exited with code 255 while idle") and replaced them all in the
    middle of the drain. It now ignores SIGTERM as the workers do (``rampart.compat.forkserver``): it lives on, no
    worker is replaced, the jobs run on the same workers; and it still ends with its parent."""
    done = subprocess.run([sys.executable, "-c", _SIGTERM_TO_THE_FORKSERVER], capture_output=True, text=True,
                          timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["alive"] and report["replaced"] == 0 and report["same_workers"], (report, done.stderr)
    assert "while idle" not in done.stderr, done.stderr

    def forkserver_gone() -> bool:
        try:
            os.kill(report["forkserver"], 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{report['forkserver']}/stat") as stat:  # a zombie until its parent's parent reaps it
            return stat.read().split(") ")[1].startswith("Z")
    _wait_for(forkserver_gone, timeout_s=10)


def test_an_upload_whose_decoder_is_killed_from_outside_is_decoded_again_and_answered():
    """SIGKILL of a decoding worker (the OOM killer under a pod's limit) is not the upload's fault: one more
    decode on another worker, and the answer. (A second death would be 400 corrupt_image, as a crash is.)"""
    settings = Settings(decode_timeout_ms=10_000, fault_decode_hang=True)
    chain = stand_in_chain(settings, pool=decode_pool(settings))
    try:
        async def scenario():
            answer = asyncio.create_task(chain.classify(encode(photo("chelsea")), 3, Deadline(20_000)))
            for _ in range(200):  # until a worker holds the (hanging) decode
                busy = [slot for slot in chain.pool._slots if slot.job is not None]
                if busy:
                    break
                await asyncio.sleep(0.02)
            chain.plan = dataclasses.replace(chain.plan, fault_hang=False)  # the next decode will not hang
            os.kill(busy[0].process.process.pid, signal.SIGKILL)
            return await answer

        answer = asyncio.run(scenario())
        assert answer["labels"][0]["index"] == 1 and answer["degraded"] is False
        _wait_for(lambda: chain.state()["decode_workers"]["replaced"] >= 1)
    finally:
        chain.pool.close()
