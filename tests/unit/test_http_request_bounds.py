"""``rampart.api.http``'s multipart parser, ``rampart.api.routing`` and ``rampart.compat.uvicorn_httptools``: bounded
request parsing, JSON 404/405, bounded metric labels and the request-head limit.

Unit tests drive ``rampart.api.http.read_multipart`` with real Starlette requests whose
body arrives in chunks, and ``rampart.api.routing`` on a Starlette app shaped like
BentoML's (its routes first, Rampart's app on a ``PassiveMount``, a static-file
mount). The end-to-end tests are in ``tests/server/test_request_bounds.py``; there
nothing asserts a wall-clock time except the liveness budget (``tests.support.bounds.LIVEZ_BUDGET_MS``, the
request bounds' contract); a part bomb is "fast" next to a plain upload of the same size, in
the same run.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.testclient import TestClient

from _bentoml_impl.server.mount import PassiveMount
from rampart import errors
from rampart.api import http
from rampart.overload.deadline import Deadline
from rampart.compat.uvicorn_httptools import HeadLimitedProtocol
from rampart.api.routing import JSONRouteErrors, route_template
from tests.support.bounds import EMPTY_PARTS_BOMB, MULTIPART, TINY_IMAGES_BOMB, form, json_error


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


def test_endpoint_labels_are_matched_once_per_path_and_random_paths_are_not_kept(bentoml_shaped_app, monkeypatch):
    from rampart.api import routing

    matched = []
    monkeypatch.setattr(routing, "route_template", lambda scope: matched.append(scope["path"]) or
                        route_template(scope))
    paths = ["/v2/models/anything/infer", "/livez"] * 3 + [f"/scan/{i}" for i in range(5)] * 2
    labels = [routing.endpoint_label({"type": "http", "method": "POST", "path": path, "root_path": "",
                                      "app": bentoml_shaped_app}) for path in paths]
    assert labels[:2] == ["/v2/models/{name}/infer", "/livez"] and set(labels[6:]) == {routing.OTHER_ENDPOINT}
    assert matched.count("/livez") == 1 and matched.count("/scan/0") == 2  # a served path once, a random one each time
    assert set(routing._ENDPOINT_LABELS[bentoml_shaped_app]) == {("POST", "/v2/models/anything/infer"), ("POST", "/livez")}


def test_plain_404_and_405_of_every_layer_become_json(bentoml_shaped_app):
    client = TestClient(bentoml_shaped_app)
    json_error(client.get("/nope"), 404, "not_found")  # the outer router
    json_error(client.get("/static_content/missing.txt"), 404, "not_found")  # the static-file app
    body = json_error(client.get("/classify"), 405, "method_not_allowed")  # the mounted app
    assert "POST" in body["message"] and client.get("/classify").headers["allow"] == "POST"
    json_error(client.post("/livez"), 405, "method_not_allowed")
    assert client.post("/classify").text == "ok" and client.get("/static_content/page.txt").text == "hi"


@pytest.mark.parametrize("method, path", [("POST", "/classify/"), ("DELETE", "/classify/"), ("GET", "/livez/"),
                                          ("POST", "/v2/models/anything/infer/")])
def test_a_trailing_slash_is_a_json_404_not_an_empty_redirect(bentoml_shaped_app, method, path):
    """Starlette's routers answered an empty 307 to the path without the slash (a client does not send its body
    again); now the JSON 404 of any unserved path, saying the routes have no trailing slash."""
    reply = TestClient(bentoml_shaped_app).request(method, path, content=b"x", follow_redirects=False)
    if path.startswith("/v2/"):
        assert reply.status_code == 404 and "trailing slash" in reply.json()["error"], reply.text
    else:
        assert "trailing slash" in json_error(reply, 404, "not_found")["message"]


def test_other_redirects_pass_unchanged():
    app = Starlette(routes=[Route("/docs", lambda r: RedirectResponse("/", status_code=307))],
                    middleware=[Middleware(JSONRouteErrors)])
    reply = TestClient(app).get("/docs", follow_redirects=False)
    assert reply.status_code == 307 and reply.headers["location"] == "/"


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


@pytest.mark.parametrize("preamble", [b"", b"\r\n", b"This is a preamble.\r\n", b"line one\r\nline two\r\n",
                                      b"x" * 70_000 + b"\r\n"], ids=["none", "blank_line", "text", "two_lines", "long"])
@pytest.mark.parametrize("chunk_size", [1, 5, 64 * 1024])
def test_a_preamble_before_the_first_boundary_is_ignored_up_to_its_limit(preamble, chunk_size):
    """RFC 2046, section 5.1.1: text before the first boundary line is a preamble, to be ignored; it was refused
    (422 "Expected boundary character"). Past ``MAX_PREAMBLE_BYTES`` without a boundary line: 422."""
    body = preamble + b'--B\r\nContent-Disposition: form-data; name="image"; filename="c.jpg"\r\n\r\nDATA\r\n--B--\r\n'
    if chunk_size == 1 and len(preamble) > 1000:
        return  # 70,000 one-byte chunks add nothing to the 5-byte case
    result, _ = read(body, chunk_size=chunk_size, content_type="multipart/form-data; boundary=B")
    if len(preamble) > http.MAX_PREAMBLE_BYTES:
        assert isinstance(result, errors.InvalidParameter) and "no boundary line in its first" in result.message
    else:
        assert result == [("c.jpg", b"DATA")], result
