"""One answer for every deadline on an idle server (docs/clients.md, "Deadlines"): below ``min_deadline_ms``
422 ``deadline_too_short``; from it on 200, never a 429, and ``deadline_exceeded`` only when the decode
really ran until the deadline's share was spent."""

from __future__ import annotations

import time

from rampart.config import Settings
from tests.support.metrics import scrape
from tests.support import PHOTOS, encode, photo

SETTINGS = Settings()  # the session server runs the defaults
#: Every degraded reason an idle server may give a deadline from the minimum on: the primary's share is
#: used up or spent (``primary_timeout``), the fallback ran out of time too (the cache or the static
#: answer), the decode did (``deadline_exceeded``). Never a 429: nothing else is in flight.
SHORT_DEADLINE_REASONS = {None, "primary_timeout", "cached_result", "no_model_available", "deadline_exceeded"}


def loop_lag_ms(server) -> float:
    """The loop lag the last request's deadline kept back (the gauge is set as each deadline is parsed)."""
    return 1000.0 * scrape(server)["rampart_event_loop_lag_seconds"][()]


def test_every_deadline_from_1_to_60_ms_gets_the_documented_answer(server, http):
    data = encode(photo("chelsea"))
    for _ in range(5):  # warm: the decoders and both runners have answered this photo
        assert http.post("/classify", content=data).status_code == 200
    minimum = SETTINGS.min_deadline_ms
    assert minimum == SETTINGS.deadlines.answer_margin_ms + SETTINGS.deadlines.min_service_ms == 50
    answers = {}
    for deadline_ms in [*range(1, 61), 80, 150, 300, 1000]:
        sent = time.perf_counter()
        response = http.post("/classify", content=data, headers={"X-Deadline-Ms": str(deadline_ms)})
        latency_ms = (time.perf_counter() - sent) * 1000.0  # covers the server's time from the first byte on
        body = response.json()
        answers[deadline_ms] = (response.status_code, body.get("degraded_reason", body.get("error")))
        if deadline_ms < minimum:
            assert response.status_code == 422 and body["error"]["code"] == "deadline_too_short", (deadline_ms, body)
            assert f"minimum deadline of {minimum} ms" in body["error"]["message"]
            continue
        assert response.status_code == 200, (deadline_ms, body)  # never a 429 on an idle server
        reason = body["degraded_reason"]
        assert reason in SHORT_DEADLINE_REASONS, (deadline_ms, body)
        if reason == "deadline_exceeded":  # the decode ran until the share (after the margins) was spent
            lag_reserve = min(loop_lag_ms(server), deadline_ms - minimum)
            share_ms = deadline_ms - SETTINGS.deadlines.answer_margin_ms - lag_reserve
            assert latency_ms >= share_ms >= SETTINGS.deadlines.min_service_ms, (deadline_ms, latency_ms, lag_reserve, body)
            assert body["labels"] == [] and body["needs_review"] is True
        elif body["model"] is not None:
            assert {label["index"] for label in body["labels"]} & PHOTOS["chelsea"], (deadline_ms, body)
    # Whether a deadline just above the minimum gets a model's answer depends on the host's speed (the
    # minimum is sized for an idle 2-core host); which answer it may get does not. The default gets the primary.
    assert answers[1000] == (200, None), answers
