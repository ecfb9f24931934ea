"""``rampart.pipeline.Pipeline`` with stand-in model endpoints: decode bounds and the chain, no server."""

from __future__ import annotations

import asyncio
import functools

import pytest
from PIL import Image

from rampart import errors
from rampart.inputs.buckets import buckets_for_resolution
from rampart.config import Settings
from rampart.overload.deadline import Deadline
from rampart.inputs.decode_job import model_input, prepare
from rampart.pipeline import Pipeline, ModelEndpoint
from rampart.inputs.pool import BoundedPool
from tests.support import encode, photo
from tests.unit.standins import LABELS, StandIn, stand_in_chain

@functools.lru_cache(maxsize=1)
def big_png() -> bytes:
    return encode(Image.fromarray(photo("rocket")).resize((4000, 3000)), "PNG")


def test_a_decode_running_past_its_limit_is_422_decode_timeout():
    slow = stand_in_chain(Settings(decode_timeout_ms=1))
    with pytest.raises(errors.DecodeTimeout) as error:
        asyncio.run(slow.classify(big_png(), 5, Deadline(10_000)))
    assert error.value.status == 422


def test_decode_capacity_exhausted_is_429_with_retry_after():
    one_slot = stand_in_chain(Settings(), pool=BoundedPool(workers=1, queue=0))
    data = big_png()

    async def two_at_once():
        return await asyncio.gather(*(one_slot.classify(data, 5, Deadline(10_000)) for _ in range(2)),
                                    return_exceptions=True)

    outcomes = asyncio.run(two_at_once())
    refused = [o for o in outcomes if isinstance(o, errors.Overloaded)]
    assert len(refused) == 1 and refused[0].retry_after_s >= 1 and "decoding capacity" in str(refused[0])
    assert any(isinstance(o, dict) and o["labels"][0]["index"] == 1 for o in outcomes)


def test_chain_primary_error_then_fallback_then_cache():
    chain = stand_in_chain(Settings(), fail=True)
    data = encode(photo("chelsea"))
    answer = asyncio.run(chain.classify(data, 3, Deadline(5_000)))
    assert answer["degraded_reason"] == "primary_error" and answer["labels"][0]["index"] == 2
    assert answer["model"]["name"] == "fallback" and answer["bucket"] == "landscape"


def test_slow_primary_times_out_at_deadline_minus_reserve():
    chain = stand_in_chain(Settings(), delay_s=5.0)
    answer = asyncio.run(chain.classify(encode(photo("coffee")), 3, Deadline(1_000, fallback_reserve_ms=300)))
    assert answer["degraded_reason"] == "primary_timeout" and answer["model"]["name"] == "fallback"
    assert answer["timings_ms"]["total"] < 1_000


class RankRecordingPool(BoundedPool):
    """The real thread pool, noting the decode ``rank`` of each job it is given."""

    def __init__(self) -> None:
        super().__init__(2, 8)
        self.ranks: list[int] = []

    async def run(self, fn, *args, rank: int = 0, **kwargs):
        self.ranks.append(rank)
        return await super().run(fn, *args, rank=rank, **kwargs)


def test_an_upload_the_primary_took_decodes_before_one_sent_to_the_fallback():
    """The primary keeps its capacity under overload: the decoders must feed the primary first."""
    pool = RankRecordingPool()
    service = stand_in_chain(Settings(), pool=pool)
    data = encode(photo("chelsea"))
    assert asyncio.run(service.classify(data, 1, Deadline(10_000)))["degraded_reason"] is None
    held = []
    while service.primary.gate.refusal(False, 10.0) is None:  # fill the primary's gate
        held.append(service.primary.gate.reserve(False, 10.0))
    assert asyncio.run(service.classify(data, 1, Deadline(10_000)))["degraded_reason"] == "primary_overloaded"
    assert pool.ranks == [0, 1]


def recording_endpoint(name: str, resolution: int, best: int, fail: bool = False) -> tuple[ModelEndpoint, list]:
    """A ``StandIn`` answering class ``best`` (raising when ``fail``) that also records the (bucket name, pixel shape) of every call."""
    calls: list = []
    inner = StandIn(best)
    inner.mode = "error" if fail else "ok"

    async def call(bucket_name, pixels, deadline):
        calls.append((bucket_name, pixels.shape))
        return await inner.call(bucket_name, pixels, deadline)

    return ModelEndpoint(name, "v1", LABELS, buckets_for_resolution(resolution), call), calls


@pytest.mark.parametrize("primary_fails", [False, True])
def test_the_fallbacks_input_is_made_only_when_the_fallback_is_called(primary_fails):
    primary, primary_calls = recording_endpoint("primary", 260, 1, fail=primary_fails)
    fallback, fallback_calls = recording_endpoint("fallback", 224, 2)
    chain = Pipeline(Settings(), primary, fallback, BoundedPool(2, 8))
    answer = asyncio.run(chain.classify(encode(photo("chelsea")), 3, Deadline(5_000)))
    assert primary_calls == [("landscape", (260, 346, 3))]
    if primary_fails:
        assert fallback_calls == [("landscape", (224, 298, 3))] and answer["model"]["name"] == "fallback"
        assert set(answer.inputs) == {"primary", "fallback"}
    else:
        assert fallback_calls == [] and answer["model"]["name"] == "primary"
        assert set(answer.inputs) == {"primary"}  # no second resize for a model that was not asked


def test_an_upload_sent_to_the_fallback_at_admission_is_decoded_for_the_fallback():
    """The fallback's input is fitted from the decoded frame, not resized from a primary array no model asked for."""
    primary, primary_calls = recording_endpoint("primary", 260, 1)
    fallback, fallback_calls = recording_endpoint("fallback", 224, 2)
    chain = Pipeline(Settings(), primary, fallback, BoundedPool(2, 8))
    while chain.primary.gate.refusal(False, 10.0) is None:  # fill the primary's gate
        chain.primary.gate.reserve(False, 10.0)
    data = encode(photo("chelsea"))
    answer = asyncio.run(chain.classify(data, 3, Deadline(5_000)))
    assert answer["degraded_reason"] == "primary_overloaded" and primary_calls == []
    assert fallback_calls == [("landscape", (224, 298, 3))] and set(answer.inputs) == {"fallback"}
    direct = prepare(data, chain.plan, "fallback")
    assert direct.base == "fallback"
    assert (answer.inputs["fallback"][1] == direct.inputs["fallback"][1]).all()
    from_primary = model_input(prepare(data, chain.plan), "fallback", fallback.buckets)[1]
    assert (answer.inputs["fallback"][1] != from_primary).any()  # the two ways differ: the test sees which ran


def test_a_runner_result_off_the_wire_keeps_its_fields_and_an_expired_one_has_no_probs():
    """``RunnerResult.from_wire``: the runner's pydantic ``RunnerResult`` as the pipeline holds it."""
    import numpy as np

    from rampart.pipeline import RunnerResult
    from runners.common import RunnerResult as WireResult

    probs = np.full(5, 0.2, dtype=np.float32)
    live = RunnerResult.from_wire(WireResult(probs=probs, batch_size=3, inference_ms=7.5))
    assert live.probs is probs and (live.expired, live.batch_size, live.inference_ms) == (False, 3, 7.5)
    dropped = RunnerResult.from_wire(WireResult(expired=True))
    assert dropped.probs is None and (dropped.expired, dropped.batch_size, dropped.inference_ms) == (True, 0, 0.0)


@pytest.mark.parametrize("decoder_idle", [True, False])
def test_after_the_primary_fails_the_fallback_input_is_decoded_again_only_from_an_idle_decoder(decoder_idle):
    """The fallback's input resized from the primary's array agrees less with a decode for the fallback
    (docs/decoding.md): after the primary failed, an idle decoder decodes the upload again for the
    fallback; a busy one is never waited for, and the resize is used."""
    import threading

    pool = BoundedPool(1, 8)
    release = threading.Event()
    fallback, fallback_calls = recording_endpoint("fallback", 224, 2)
    inner = StandIn(1)
    inner.mode = "error"
    blocker = []

    async def failing_primary(bucket_name, pixels, deadline):
        if not decoder_idle:  # the only decoder gets another upload's job before the fallback is asked
            blocker.append(asyncio.ensure_future(pool.run(release.wait, 5.0)))
            await asyncio.sleep(0.05)
        return await inner.call(bucket_name, pixels, deadline)

    primary = ModelEndpoint("primary", "v1", LABELS, buckets_for_resolution(260), failing_primary)
    chain = Pipeline(Settings(), primary, fallback, pool)
    data = encode(photo("chelsea"))

    async def run():
        try:
            return await chain.classify(data, 3, Deadline(5_000))
        finally:
            release.set()
            await asyncio.gather(*blocker)

    answer = asyncio.run(run())
    assert answer["model"]["name"] == "fallback" and fallback_calls == [("landscape", (224, 298, 3))]
    decoded_for_fallback = prepare(data, chain.plan, "fallback").inputs["fallback"][1]
    resized = model_input(prepare(data, chain.plan), "fallback", fallback.buckets)[1]
    expected = decoded_for_fallback if decoder_idle else resized
    assert (answer.inputs["fallback"][1] == expected).all()
