"""``rampart.api.http``'s parsers on minimal Starlette requests (an ASGI scope and a ``receive`` callable): the
deadline, ``top_k`` and priority headers, and the streaming multipart parser at and just past each limit."""

from __future__ import annotations

import asyncio
import time

import pytest
from starlette.requests import Request

from rampart import errors

from rampart.api import http
from rampart.api.arrival import ARRIVAL_KEY
from rampart.config import Settings
from rampart.overload.deadline import Deadline, Share

SETTINGS = Settings(default_deadline_ms=1000, max_deadline_ms=60_000, answer_margin_ms=20, fallback_reserve_ms=250)


class Body:
    """A ``receive`` callable that sends ``chunks`` (the last one ends the body unless ``then`` is given),
    then ``then``: ``"http.disconnect"`` (the client hangs up) or ``"wait"`` (it stops sending); counts the
    messages read."""

    def __init__(self, *chunks: bytes, then: str | None = None) -> None:
        self.chunks, self.then, self.read = list(chunks), then, 0

    async def __call__(self) -> dict:
        self.read += 1
        if self.read <= len(self.chunks):
            more = self.read < len(self.chunks) or self.then is not None
            return {"type": "http.request", "body": self.chunks[self.read - 1], "more_body": more}
        if self.then == "wait":
            await asyncio.Event().wait()
        return {"type": self.then}


def request(headers: dict[str, str] | None = None, query: str = "", body: Body | None = None,
            **scope: object) -> Request:
    """A Starlette ``POST /`` request with ``headers``, query string ``query`` and ``body`` (default: empty)."""
    raw = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in (headers or {}).items()]
    asgi = {"type": "http", "method": "POST", "path": "/", "query_string": query.encode(), "headers": raw, **scope}
    return Request(asgi, body or Body(b""))


# -- X-Deadline-Ms and X-Request-Start --------------------------------------------------------------

def test_no_header_is_the_default_deadline_sliced_by_the_settings():
    deadline = http.parse_deadline(request(), SETTINGS)
    assert (deadline.budget_ms, deadline.margin_ms, deadline.fallback_reserve_ms) == (1000, 20, 250)
    assert deadline.share_ms(Share.ALL) == 980 and deadline.share_ms(Share.PRIMARY) == 730
    assert deadline.arrival.source == "handler" and deadline.before_handler_ms() == 0.0


@pytest.mark.parametrize("raw, budget_ms", [("500", 500), ("250.5", 250.5), ("50", 50), ("1e3", 1000),
                                             ("60000", 60_000), ("60001", 60_000), ("1e9", 60_000), ("+500", 500),
                                             (" 500\t", 500), ("500.", 500), ("1E+3", 1000)])
def test_a_valid_header_is_the_budget_capped_at_max_deadline_ms(raw, budget_ms):
    assert http.parse_deadline(request({"X-Deadline-Ms": raw}), SETTINGS).budget_ms == budget_ms


@pytest.mark.parametrize("raw", ["", "abc", "0", "-5", "nan", "inf", "-inf", "1e400", "5ms", "1_000", "0x100",
                                 "infinity", "1e", ".", "++5"])
def test_an_invalid_header_is_422_invalid_parameter(raw):
    with pytest.raises(errors.InvalidParameter) as error:
        http.parse_deadline(request({"X-Deadline-Ms": raw}), SETTINGS)
    assert error.value.status == 422 and error.value.code == "invalid_parameter"


def raw_request(*headers: tuple[str, str]) -> Request:
    """A ``POST /`` request with ``headers`` as given, repeats included."""
    raw = [(name.lower().encode("latin-1"), value.encode("utf-8")) for name, value in headers]
    return Request({"type": "http", "method": "POST", "path": "/", "query_string": b"", "headers": raw}, Body(b""))


@pytest.mark.parametrize("name", ["X-Deadline-Ms", "X-Priority"])
def test_a_header_sent_twice_with_different_values_is_422_and_with_the_same_value_is_read(name):
    first, second = ("1000", "5") if name == "X-Deadline-Ms" else ("high", "low")
    readers = [lambda r: http.parse_deadline(r, SETTINGS)] + ([http.parse_priority] if name == "X-Priority" else [])
    for parse in readers:  # the deadline reads X-Priority too (a low request's default deadline)
        with pytest.raises(errors.InvalidParameter, match=f"{name.lower()} is sent 2 times with different values"):
            parse(raw_request((name, first), (name, second)))
    same = raw_request((name, first), (name, first))
    assert (http.parse_deadline(same, SETTINGS).budget_ms == 1000 if name == "X-Deadline-Ms"
            else http.parse_priority(same) == "high")


@pytest.mark.parametrize("raw, settings", [("49.9", {}), ("20", {}), ("0.5", {}), ("59", {"min_service_ms": 40}),
                                           ("39", {"answer_margin_ms": 10})])
def test_a_deadline_below_min_deadline_ms_is_422_deadline_too_short(raw, settings):
    """The minimum is ``answer_margin_ms`` + ``min_service_ms``: 50, 60 and 40 ms here."""
    given = Settings(**{**SETTINGS.model_dump(), **settings})
    with pytest.raises(errors.DeadlineTooShort) as error:
        http.parse_deadline(request({"X-Deadline-Ms": raw}), given)
    assert error.value.status == 422 and error.value.code == "deadline_too_short"
    assert http.parse_deadline(request({"X-Deadline-Ms": str(given.min_deadline_ms)}), given).budget_ms == given.min_deadline_ms


def test_the_loop_lag_reserve_never_cuts_an_accepted_deadline_below_min_service_ms():
    """A deadline at the minimum keeps ``min_service_ms`` (30) whatever the lag; above it the lag is
    kept back up to the excess."""
    for raw, lag, share in (("50", 75, 30), ("60", 75, 30), ("60", 4, 36), ("200", 75, 105)):
        deadline = http.parse_deadline(request({"X-Deadline-Ms": raw}), SETTINGS, loop_lag_ms=lag)
        assert deadline.share_ms(Share.ALL) == share, (raw, lag)


def test_the_loop_lag_is_kept_back_with_the_answer_margin():
    calm = http.parse_deadline(request({"X-Deadline-Ms": "1000"}), SETTINGS)
    lagging = http.parse_deadline(request({"X-Deadline-Ms": "1000"}), SETTINGS, loop_lag_ms=75)
    assert lagging.margin_ms == calm.margin_ms + 75 == 95
    assert lagging.share_ms(Share.ALL) == calm.share_ms(Share.ALL) - 75
    assert lagging.share_ms(Share.PRIMARY) == calm.share_ms(Share.PRIMARY) - 75


@pytest.mark.parametrize("scale", [1, 1e3, 1e6], ids=["s", "ms", "us"])
def test_x_request_start_in_s_ms_or_us_starts_the_clock_earlier(scale):
    stamp = (time.time() - 0.4) * scale
    raw = f"t={stamp:.3f}" if scale == 1 else f"t={int(stamp)}"
    deadline = http.parse_deadline(request({"X-Deadline-Ms": "1000", "X-Request-Start": raw}), SETTINGS)
    assert deadline.arrival.source == "x-request-start"
    assert 399 <= deadline.before_handler_ms() < 450 and 399 <= deadline.elapsed_ms() < 450
    assert deadline.remaining_s() == pytest.approx((980 - deadline.elapsed_ms()) / 1000, abs=0.005)


@pytest.mark.parametrize("age_s", [61.0, -2.0], ids=["older-than-max-deadline", "from-the-future"])
def test_x_request_start_outside_its_sanity_bound_is_ignored(age_s):
    raw = f"t={time.time() - age_s:.3f}"
    deadline = http.parse_deadline(request({"X-Request-Start": raw}), SETTINGS)
    assert deadline.arrival.source == "handler" and deadline.elapsed_ms() < 50


def test_the_first_byte_starts_the_clock_and_a_second_parse_keeps_that_arrival():
    first_byte = time.monotonic() - 0.2
    scoped = request({"X-Deadline-Ms": "900"}, **{ARRIVAL_KEY: first_byte})
    deadline = http.parse_deadline(scoped, SETTINGS)
    assert deadline.arrival.source == "first-byte" and deadline.start_monotonic == first_byte
    # A deadline given again later (OIP's parameters) counts from the same arrival.
    again = http.parse_deadline(request({"X-Deadline-Ms": "500"}), SETTINGS, arrival=deadline.arrival)
    assert again.budget_ms == 500 and again.arrival is deadline.arrival
    assert (again.start_monotonic, again.start_wall) == (deadline.start_monotonic, deadline.start_wall)


# -- top_k and X-Priority -------------------------------------------------------------------------------

@pytest.mark.parametrize("query, top_k", [("", 5), ("top_k=1", 1), ("top_k=20", 20), ("top_k=07", 7)])
def test_top_k_is_an_integer_in_1_to_20_default_5(query, top_k):
    assert http.parse_top_k(request(query=query)) == top_k


@pytest.mark.parametrize("raw", ["0", "21", "-1", "1.5", "five", "", "1_0", "%2B5", "%D9%A3", "%EF%BC%95", "5%0A"])
def test_top_k_outside_1_to_20_or_not_an_integer_is_422(raw):
    with pytest.raises(errors.InvalidParameter) as error:
        http.parse_top_k(request(query=f"top_k={raw}"))
    assert error.value.status == 422


@pytest.mark.parametrize("query, top_k", [("top_k=3&top_k=3", 3), ("top_k=3&top_k=%203", 3), ("top_k=3&x=1", 3)])
def test_top_k_given_twice_alike_is_taken(query, top_k):
    assert http.parse_top_k(request(query=query)) == top_k


def test_top_k_given_twice_with_different_values_is_422_as_for_a_header():
    """``?top_k=3&top_k=4`` was answered with 3 labels: the first won silently."""
    with pytest.raises(errors.InvalidParameter, match="top_k is given 2 times with different values"):
        http.parse_top_k(request(query="top_k=3&top_k=4"))


@pytest.mark.parametrize("raw, priority", [(None, "normal"), ("normal", "normal"), ("NORMAL", "normal"),
                                           ("high", "high"), (" High ", "high"), ("low", "low"), ("LOW ", "low")])
def test_priority_is_high_normal_or_low_in_any_case(raw, priority):
    assert http.parse_priority(request({} if raw is None else {"X-Priority": raw})) == priority


def test_a_low_priority_request_without_a_deadline_gets_the_long_low_priority_default():
    settings = Settings(low_priority_deadline_ms=7000)
    low = http.parse_deadline(request({"X-Priority": "low"}), settings)
    normal = http.parse_deadline(request({}), settings)
    assert low.budget_ms == 7000 and normal.budget_ms == settings.deadlines.default_deadline_ms
    assert http.parse_deadline(request({"X-Priority": "low", "X-Deadline-Ms": "500"}), settings).budget_ms == 500


def test_a_low_priority_default_deadline_above_the_longest_deadline_is_refused():
    with pytest.raises(ValueError, match="low_priority_deadline_ms"):
        Settings(low_priority_deadline_ms=70_000)


def test_the_built_in_low_priority_default_yields_to_a_shorter_longest_deadline():
    """A server whose max_deadline_ms is below the built-in low default starts, and caps low requests at it."""
    settings = Settings(max_deadline_ms=6000)
    assert http.parse_deadline(request({"X-Priority": "low"}), settings).budget_ms == 6000


@pytest.mark.parametrize("raw", ["urgent", "1", "", "lowest"])
def test_any_other_priority_is_422(raw):
    with pytest.raises(errors.InvalidParameter) as error:
        http.parse_priority(request({"X-Priority": raw}))
    assert error.value.status == 422


# -- multipart/form-data, at each limit and one past it ---------------------------------------------------

MULTIPART = {"Content-Type": "multipart/form-data; boundary=B"}
DISPOSITION = 'Content-Disposition: form-data; name="{}"'


def part(name: str, data: bytes, *headers: str, filename: str | None = None) -> bytes:
    disposition = DISPOSITION.format(name) + (f'; filename="{filename}"' if filename else "")
    head = "\r\n".join([*headers, disposition])
    return b"--B\r\n" + head.encode() + b"\r\n\r\n" + data + b"\r\n"


def multipart(*parts: bytes, end: bytes = b"--B--\r\n") -> bytes:
    return b"".join(parts) + end


def parse(body: bytes | Body, field: str = "images", max_files: int = 2, part_limit: int = 1000,
          headers: dict[str, str] = MULTIPART, deadline_ms: float = 10_000):
    """``read_multipart``'s files, or the ``RampartError`` it raised."""
    receive = body if isinstance(body, Body) else Body(body)
    try:
        return asyncio.run(http.read_multipart(request(headers, body=receive), field, max_files, part_limit,
                                               Deadline(deadline_ms)))
    except errors.RampartError as error:
        return error


def refused(outcome, kind: type[errors.RampartError], status: int) -> bool:
    return isinstance(outcome, kind) and outcome.status == status


def test_only_parts_with_the_field_name_are_kept_and_none_is_400_empty_body():
    body = multipart(part("image", b"one"), part("images", b"two", filename="b.jpg"), part("note", b"x"))
    assert parse(body, field="images") == [("b.jpg", b"two")]
    assert parse(body, field="image") == [("", b"one")]
    assert refused(parse(body, field="picture"), errors.EmptyBody, 400)


def test_part_count_limits_named_and_others():
    assert len(parse(multipart(*[part("images", b"x")] * 2), max_files=2)) == 2
    assert refused(parse(multipart(*[part("images", b"x")] * 3), max_files=2), errors.TooManyParts, 413)
    others = [part("note", b"x")] * http.MAX_OTHER_PARTS
    assert len(parse(multipart(*[part("images", b"x")] * 2, *others), max_files=2)) == 2
    over = multipart(*[part("images", b"x")] * 2, *others, part("note", b"x"))
    assert refused(parse(over, max_files=2), errors.TooManyParts, 413)


def test_byte_caps_per_part_and_for_the_whole_body():
    assert parse(multipart(part("images", b"x" * 1000)), part_limit=1000) == [("", b"x" * 1000)]
    assert refused(parse(multipart(part("images", b"x" * 1001)), part_limit=1000), errors.PayloadTooLarge, 413)
    cap = 2 * (1000 + http.MULTIPART_OVERHEAD_BYTES)  # max_files × (part_limit + overhead)
    # A skipped part counts towards the whole body's cap while it streams in ...
    streamed = multipart(part("note", b"x" * cap), part("images", b"x"))
    assert refused(parse(streamed, max_files=2, part_limit=1000), errors.PayloadTooLarge, 413)
    # ... and a declared Content-Length over it is refused before anything is read.
    declared = Body(multipart(part("images", b"x")))
    outcome = parse(declared, max_files=2, part_limit=1000, headers={**MULTIPART, "Content-Length": str(cap + 1)})
    assert refused(outcome, errors.PayloadTooLarge, 413) and declared.read == 0
    # A Content-Length in other digits ('²' is a latin-1 digit to str.isdigit, not to int) is no number: the
    # body streams, and its real size decides.
    small = parse(multipart(part("images", b"x")), max_files=2, part_limit=1000,
                  headers={**MULTIPART, "Content-Length": "\u00b2"})
    assert small == [("", b"x")]


@pytest.mark.parametrize("raw, number", [("0", 0), ("007", 7), (" 12\t", 12), ("9" * 20, int("9" * 20)), ("", None),
                                         ("9" * 21, None), ("\u00b2", None), ("\u0663", None), ("1_0", None),
                                         ("+1", None), ("-1", None), ("1.0", None), ("1 0", None)])
def test_a_whole_number_is_1_to_20_ascii_digits(raw, number):
    assert http.ascii_decimal(raw) == number


def test_part_headers_at_their_limits_are_read_one_more_line_or_byte_is_413():
    lines = [f"X-Header-{i}: v" for i in range(http.MAX_PART_HEADERS - 1)]  # + Content-Disposition
    assert parse(multipart(part("images", b"x", *lines))) == [("", b"x")]
    assert refused(parse(multipart(part("images", b"x", *lines, "X-One-More: v"))), errors.PartHeadersTooLarge, 413)
    longest = "X-Pad: " + "a" * (http.MAX_PART_HEADER_LINE_BYTES - len("X-Pad: "))
    assert parse(multipart(part("images", b"x", longest))) == [("", b"x")]
    assert refused(parse(multipart(part("images", b"x", longest + "a"))), errors.PartHeadersTooLarge, 413)


def test_a_body_ending_before_its_closing_boundary_is_422():
    assert refused(parse(multipart(part("images", b"x"), end=b"")), errors.InvalidParameter, 422)
    assert refused(parse(multipart(part("images", b"x"), end=b"--B")), errors.InvalidParameter, 422)


def test_a_content_type_without_boundary_is_422():
    outcome = parse(multipart(part("images", b"x")), headers={"Content-Type": "multipart/form-data"})
    assert refused(outcome, errors.InvalidParameter, 422)


def test_a_body_that_stops_arriving_is_408_and_a_hang_up_is_499():
    half = multipart(part("images", b"x"))[:20]
    assert refused(parse(Body(half, then="wait"), deadline_ms=50), errors.RequestTimeout, 408)
    assert refused(parse(Body(half, then="http.disconnect")), errors.ClientDisconnected, 499)


def test_a_request_id_sent_twice_is_kept_when_the_same_and_replaced_by_a_new_one_when_they_differ():
    """``X-Request-Id`` is only echoed, so two different ones are not an error (its body would need an id): the
    client gets a fresh id, not the first it sent as if the second did not exist."""
    assert http.request_id_of(raw_request(("X-Request-Id", "abc-1"), ("X-Request-Id", "abc-1"))) == "abc-1"
    fresh = http.request_id_of(raw_request(("X-Request-Id", "abc-1"), ("X-Request-Id", "abc-2")))
    assert fresh not in ("abc-1", "abc-2") and len(fresh) == 32
