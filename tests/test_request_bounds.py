"""Bounded request parsing, JSON 404/405, bounded metric labels and the request-head limit.

Unit tests drive ``rampart.http.read_multipart`` with real Starlette requests whose
body arrives in chunks, and ``rampart.routing`` on a Starlette app shaped like
BentoML's (its routes first, Rampart's app on a ``PassiveMount``, a static-file
mount). The end-to-end tests use the session's default server. Nothing asserts a
wall-clock time except the liveness budget (``LIVEZ_BUDGET_MS``, the issue's
contract); a part bomb is "fast" next to a plain upload of the same size, in the
same run.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.testclient import TestClient

from _bentoml_impl.server.mount import PassiveMount
from rampart import errors, http
from rampart.deadline import Deadline
from rampart.headlimit import MAX_HEAD_BYTES, HeadLimitedProtocol
from rampart.routing import OTHER_ENDPOINT, JSONRouteErrors, route_template
from tests.conftest import PHOTOS, encode, photo
from tests.test_observability import scrape

#: /livez must answer within this while part bombs are parsed (issue 10's contract).
LIVEZ_BUDGET_MS = 100
#: A part bomb is refused in at most this multiple of the time a plain upload of the same size takes.
BOMB_TO_UPLOAD_RATIO = 3.0


def form(parts: list[tuple[str, str | None, bytes]], boundary: bytes = b"B") -> bytes:
    """A multipart/form-data body of ``(name, filename or None, data)`` parts."""
    out = []
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out.append(b"--" + boundary + b"\r\nContent-Disposition: " + disposition.encode() + b"\r\n\r\n" + data + b"\r\n")
    return b"".join(out) + b"--" + boundary + b"--\r\n"


#: 2 million empty parts, 18 MB: under the /classify byte cap (issue 10).
EMPTY_PARTS_BOMB = b"--B\r\n\r\n\r\n" * 2_000_000 + b"--B--\r\n"
#: 100,000 tiny image parts, 7.5 MB (issue 10).
TINY_IMAGES_BOMB = form([("images", str(i), b"x") for i in range(100_000)])
MULTIPART = {"Content-Type": "multipart/form-data; boundary=B"}


class ChunkedRequest:
    """A real Starlette ``Request`` whose body arrives in ``chunk_size`` pieces; counts the pieces read."""

    def __init__(self, body: bytes, chunk_size: int = 64 * 1024, content_type: str = MULTIPART["Content-Type"]):
        self.chunks = [body[i:i + chunk_size] for i in range(0, len(body), chunk_size)]
        self.read = 0
        scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"",
                 "headers": [(b"content-type", content_type.encode())]}
        self.request = Request(scope, self.receive)

    async def receive(self) -> dict:
        self.read += 1
        more = self.read < len(self.chunks)
        return {"type": "http.request", "body": self.chunks[self.read - 1], "more_body": more}


def read(body: bytes, field: str = "image", max_files: int = 1, part_limit: int = 20_000_000, **kwargs):
    chunked = ChunkedRequest(body, **kwargs)
    try:
        return asyncio.run(http.read_multipart(chunked.request, field, max_files, part_limit, Deadline(10_000))), chunked
    except errors.RampartError as error:
        return error, chunked


def test_multipart_keeps_the_named_parts_in_order_and_skips_others():
    body = form([("note", None, b"hello"), ("images", "a.jpg", b"\xff\xd8a"), ("images", None, b"b" * 100_000)])
    files, _ = read(body, "images", 16, chunk_size=1000)
    assert files == [("a.jpg", b"\xff\xd8a"), ("", b"b" * 100_000)]


@pytest.mark.parametrize("body, field, max_files, code", [
    (EMPTY_PARTS_BOMB, "image", 1, "too_many_parts"),
    (TINY_IMAGES_BOMB, "images", 16, "too_many_parts"),
    (form([("image", None, b"x")] * 2), "image", 1, "too_many_parts"),
    (form([("images", None, b"x")] * 17), "images", 16, "too_many_parts"),
    (form([("other", None, b"x")] * (16 + http.MAX_OTHER_PARTS + 1)), "images", 16, "too_many_parts"),
    (b'--B\r\nContent-Disposition: form-data; name="image"' + b"; a=b" * 60_000 + b"\r\n\r\nx\r\n--B--\r\n",
     "image", 1, "part_headers_too_large"),
    (b"--B\r\n" + b"X-A: b\r\n" * 9 + b'Content-Disposition: form-data; name="image"\r\n\r\nx\r\n--B--\r\n',
     "image", 1, "part_headers_too_large"),
    (form([("image", None, b"x" * 1_000_001)]), "image", 1, "payload_too_large"),
    (form([("image", None, b"x" * 1000)])[:-8], "image", 1, "invalid_parameter"),
    (b"not multipart at all", "image", 1, "invalid_parameter"),
    (form([("picture", None, b"x")]), "image", 1, "empty_body"),
])
def test_multipart_limits_refuse_at_the_first_part_over_them(body, field, max_files, code):
    error, _ = read(body, field, max_files, part_limit=1_000_000)
    assert isinstance(error, errors.RampartError) and error.code == code, error


@pytest.mark.parametrize("body, field, max_files", [(EMPTY_PARTS_BOMB, "image", 1), (TINY_IMAGES_BOMB, "images", 16)])
def test_part_bombs_are_refused_in_their_first_chunk(body, field, max_files):
    error, chunked = read(body, field, max_files)
    assert isinstance(error, errors.TooManyParts) and chunked.read == 1 < len(chunked.chunks), (error, chunked.read)


def test_multipart_parser_yields_to_the_event_loop_between_slices():
    """A 1.8 MB chunk of near-boundaries (python-multipart's slowest input) is parsed in slices, others run between."""
    body = form([("image", None, b"\r\n--Bx" * 300_000)])

    async def parse_while_ticking() -> tuple[int, int]:
        ticks, done = 0, asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0)

        chunked = ChunkedRequest(body, chunk_size=len(body))
        ticking = asyncio.create_task(ticker())
        files = await http.read_multipart(chunked.request, "image", 1, 20_000_000, Deadline(60_000))
        done.set()
        await ticking
        return ticks, len(files[0][1])

    ticks, size = asyncio.run(parse_while_ticking())
    assert size == 6 * 300_000
    assert ticks >= len(body) // http.PARSE_SLICE_BYTES - 1


def json_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, (response.status_code, response.text[:300])
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()["error"]
    assert body["code"] == code and body["message"] and body["request_id"], body
    return body


@pytest.fixture(scope="module")
def bentoml_shaped_app(tmp_path_factory) -> Starlette:
    """BentoML's outer-app shape: its routes, Rampart's app on a PassiveMount at /, a static mount, JSONRouteErrors."""
    static = tmp_path_factory.mktemp("static")
    (Path(static) / "page.txt").write_text("hi")
    inner = Starlette(routes=[Route("/classify", lambda r: PlainTextResponse("ok"), methods=["POST"]),
                              Route("/v2/models/{name}/infer", lambda r: PlainTextResponse("ok"), methods=["POST"])])
    return Starlette(routes=[Route("/livez", lambda r: PlainTextResponse("")),
                             Route("/metrics", lambda r: PlainTextResponse("")),
                             PassiveMount("/", inner),
                             Mount("/static_content", StaticFiles(directory=static))],
                     middleware=[Middleware(JSONRouteErrors)])


@pytest.mark.parametrize("method, path, template", [
    ("POST", "/classify", "/classify"), ("GET", "/classify", "/classify"), ("GET", "/livez", "/livez"),
    ("POST", "/v2/models/anything/infer", "/v2/models/{name}/infer"), ("GET", "/static_content/x", "/static_content"),
    ("GET", "/nope", None), ("GET", "/classify/", None), ("PUT", "/v2/models", None),
])
def test_route_template_names_routes_by_template(bentoml_shaped_app, method, path, template):
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "app": bentoml_shaped_app}
    assert route_template(scope) == template


def test_plain_404_and_405_of_every_layer_become_json(bentoml_shaped_app):
    client = TestClient(bentoml_shaped_app)
    json_error(client.get("/nope"), 404, "not_found")  # the outer router
    json_error(client.get("/static_content/missing.txt"), 404, "not_found")  # the static-file app
    body = json_error(client.get("/classify"), 405, "method_not_allowed")  # the mounted app
    assert "POST" in body["message"] and client.get("/classify").headers["allow"] == "POST"
    json_error(client.post("/livez"), 405, "method_not_allowed")
    assert client.post("/classify").text == "ok" and client.get("/static_content/page.txt").text == "hi"


def test_unknown_paths_and_wrong_methods_get_json_404_and_405(http):
    body = json_error(http.get("/no/such/path", headers={"X-Request-Id": "nf-1"}), 404, "not_found")
    assert body["request_id"] == "nf-1"
    wrong = http.delete("/classify")
    json_error(wrong, 405, "method_not_allowed")
    assert wrong.headers["allow"] == "POST"
    json_error(http.post("/livez"), 405, "method_not_allowed")
    json_error(http.put("/metrics"), 405, "method_not_allowed")
    json_error(http.get("/classify_batch/x"), 404, "not_found")


def test_metric_series_do_not_grow_with_random_paths_and_methods(server, http):
    rng = random.Random(10)
    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
    wrong_methods = ["PUT", "DELETE", "PATCH"]  # served by none of the known paths
    known = ["/classify", "/classify_batch", "/stats", "/livez", "/readyz", "/metrics", "/healthz"]
    unknown = [lambda: f"/{rng.getrandbits(64):x}", lambda: f"/classify/{rng.getrandbits(32):x}",
               lambda: f"/static_content/{rng.getrandbits(32):x}", lambda: f"{rng.choice(known)}{rng.randint(0, 9)}"]

    def send(method: str, path: str) -> None:
        assert http.request(method, path).status_code in (404, 405), (method, path)

    # One request of each kind first: each may add its one series (endpoint label, status).
    for kind in unknown:
        for method in methods:
            send(method, kind())
    for path in known:
        for method in wrong_methods:
            send(method, path)
    before = set(series(scrape(server)))
    for _ in range(300):
        if rng.random() < 0.8:
            send(rng.choice(methods), rng.choice(unknown)())
        else:
            send(rng.choice(wrong_methods), rng.choice(known))
    after = set(series(scrape(server)))
    assert after == before, {"new": sorted(after - before)[:10], "gone": sorted(before - after)[:10]}
    assert any(dict(labels).get("endpoint") == OTHER_ENDPOINT for _, labels in after)


def series(samples: dict) -> list[tuple[str, tuple]]:
    return [(name, labels) for name, values in samples.items() for labels in values]


def test_classify_batch_sends_server_timing(http):
    files = [("images", ("cat.jpg", encode(photo("chelsea")))), ("images", ("junk.bin", b"junk"))]
    response = http.post("/classify_batch", files=files)
    assert response.status_code == 200, response.text
    timing = dict(part.strip().split(";dur=") for part in response.headers["server-timing"].split(","))
    assert set(timing) == {"decode", "queue", "inference", "total"}
    assert float(timing["total"]) >= float(timing["inference"]) > 0
    assert {label["index"] for label in response.json()["results"][0]["labels"]} & PHOTOS["chelsea"]


def send_raw(server, data: bytes, piece: int) -> bytes:
    """Send ``data`` in ``piece``-byte writes on a raw connection; the reply (the server may close early)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        try:
            for start in range(0, len(data), piece):
                sock.sendall(data[start:start + piece])
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def test_head_is_counted_up_to_its_blank_line_wherever_the_reads_split_it():
    protocol = HeadLimitedProtocol.__new__(HeadLimitedProtocol)  # only the byte count, no connection
    head = b"POST /classify HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n"
    protocol._head_tail = b""
    assert protocol._head_part(head + b"\r\n\r\n") == len(head)  # in one read, with a body
    for cut in range(1, len(head)):  # in two reads: the parser sees the head end in the second
        protocol._head_tail, counted = b"", 0
        for data in (head[:cut], head[cut:] + b"\r\n\r\n"):  # a body that looks like another head end
            counted += protocol._head_part(data)
            protocol._head_tail = (protocol._head_tail + data[-3:])[-3:]
        assert counted == len(head), cut


@pytest.mark.parametrize("head", [
    b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1_000_000 + b"\r\n\r\n",
    b"GET /livez HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 1000) for i in range(70)) + b"\r\n",
    b"GET /" + b"a" * (MAX_HEAD_BYTES + 1) + b" HTTP/1.1\r\nHost: x\r\n\r\n",
])
def test_request_head_over_the_limit_gets_431_json(server, head):
    for piece in (len(head), 1000):  # in one write and trickled in pieces
        reply = send_raw(server, head, piece)
        assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]
        assert b'"code":"headers_too_large"' in reply and b"application/json" in reply


def test_request_head_under_the_limit_is_served(http):
    headers = {f"X-{i}": "a" * 1000 for i in range(MAX_HEAD_BYTES // 1100)}
    assert http.get("/livez", headers=headers).status_code == 200
    assert http.post("/classify", content=encode(photo("coffee")), headers=headers).status_code == 200


def test_part_bombs_get_fast_4xx_while_livez_and_ordinary_requests_are_served(server):
    """Run under the load lock: 2 million empty parts to /classify, 100,000 tiny parts to /classify_batch."""
    stop, livez_ms, ordinary = threading.Event(), [], []

    def probe_livez() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            while not stop.is_set():
                started = time.perf_counter()
                assert client.get("/livez").status_code == 200
                livez_ms.append((time.perf_counter() - started) * 1000)
                time.sleep(0.01)

    def post(client: httpx.Client, path: str, body: bytes, headers: dict) -> tuple[float, httpx.Response]:
        started = time.perf_counter()
        response = client.post(path, content=body, headers=headers)
        return time.perf_counter() - started, response

    prober = threading.Thread(target=probe_livez)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        client.post("/classify", content=encode(photo("coffee")))  # warm the connection and the paths
        prober.start()
        try:
            for path, bomb in (("/classify", EMPTY_PARTS_BOMB), ("/classify_batch", TINY_IMAGES_BOMB)):
                plain = min(post(client, "/classify", b"\x00" * len(bomb), {})[0] for _ in range(2))  # 415 after the read
                ordinary_reply: list[httpx.Response] = []
                sender = threading.Thread(target=lambda: ordinary_reply.append(httpx.post(
                    f"{server.url}/classify", content=encode(photo("chelsea")), headers={"X-Deadline-Ms": "5000"},
                    timeout=30)))
                sender.start()
                took = []
                for _ in range(2):
                    seconds, response = post(client, path, bomb, MULTIPART)
                    json_error(response, 413, "too_many_parts")
                    took.append(seconds)
                sender.join()
                ordinary.append(ordinary_reply[0])
                assert min(took) <= BOMB_TO_UPLOAD_RATIO * plain, (path, took, plain)
        finally:
            stop.set()
            prober.join()
    assert [r.status_code for r in ordinary] == [200, 200], [r.text[:200] for r in ordinary]
    assert all({label["index"] for label in r.json()["labels"]} & PHOTOS["chelsea"] for r in ordinary)
    assert len(livez_ms) >= 5 and max(livez_ms) < LIVEZ_BUDGET_MS, sorted(livez_ms)[-5:]
