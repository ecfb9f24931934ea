"""The upstream objects Rampart's patches replace or build on, each with the SHA-256 of its source at the pins.

A patch is written against one version of its target. ``TARGETS`` records, for each patch in
``rampart.compat``, the upstream objects it replaces, wraps or relies on the inside of, and the
hash of their source text (``upstream_source``) at the pinned versions (``rampart.compat.PINS``,
kantoku 0.18.3 for circus). ``tests/unit/test_compat.py`` recomputes every hash: when an upgrade
changes a target, that test names it, and the patch must be read again against the new source
(docs/compat.md, "Upgrading BentoML") before its hash is updated here.

The source is read from the module's file with ``ast`` without importing it, so the hash is
the upstream text whether or not the patch has been applied in this process.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from dataclasses import dataclass

__all__ = ["Target", "TARGETS", "upstream_source", "source_sha256"]


@dataclass(frozen=True)
class Target:
    """One upstream object: ``patch`` (the ``rampart.compat`` function that relies on it, as
    ``module.function``), ``module`` (the upstream module's import name), ``qualname`` (a class,
    function, method or module-level assignment in it, dotted) and ``sha256`` (hex, of its source)."""

    patch: str
    module: str
    qualname: str
    sha256: str


def upstream_source(module: str, qualname: str) -> str:
    """The source text of ``qualname`` (``Class``, ``Class.method``, ``function`` or a module-level name
    assigned once) in the module ``module``, as written in its file (decorators excluded).

    Raises ``LookupError`` when the module's file or the name is not found.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise LookupError(f"no Python source for module {module}")
    with open(spec.origin, encoding="utf-8") as file:
        text = file.read()
    nodes = ast.parse(text).body
    node = None
    for part in qualname.split("."):
        node = _named(nodes, part)
        if node is None:
            raise LookupError(f"{module} has no {qualname}")
        nodes = getattr(node, "body", [])
    return ast.get_source_segment(text, node)


def _named(nodes: list, name: str):
    for node in nodes:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node
    return None


def source_sha256(module: str, qualname: str) -> str:
    """SHA-256 (hex) of ``upstream_source(module, qualname)`` encoded as UTF-8."""
    return hashlib.sha256(upstream_source(module, qualname).encode("utf-8")).hexdigest()


_TRAFFIC = "bentoml._internal.server.http.traffic"
_INSTRUMENTS = "bentoml._internal.server.http.instruments"
_HTTPTOOLS = "uvicorn.protocols.http.httptools_impl"
_HTTP_CLIENT = "_bentoml_impl.client.http"
_APP = "_bentoml_impl.server.app"

#: Every upstream object a patch depends on, with its source hash at the pinned versions.
TARGETS: tuple[Target, ...] = (
    Target("bentoml_server.cancel_request_timers", _TRAFFIC, "TimeoutMiddleware",
           "3078c89fa25ec159bef380cc8bbb1f2996d7a548445476cd71e216170d433080"),
    Target("bentoml_server.bound_endpoint_labels", _INSTRUMENTS, "RunnerTrafficMetricsMiddleware.__call__",
           "048dcbd5af3f43785785fce4b93bc1f020cf812fbf8c22ab7985919f692c678a"),
    Target("bentoml_server.bound_endpoint_labels", _INSTRUMENTS, "HTTPTrafficMetricsMiddleware.__call__",
           "79aed2567379ef0fe27b816a307c55b353340052d857a8411a5a6d27e28e87f8"),
    Target("bentoml_server.cache_io_media_types", "_bentoml_sdk.io_models", "IOMixin.mime_type",
           "d69fd7e8d28f73a6da988178b5257884ee8e8989ba38607b0959319f63acbb8e"),
    Target("bentoml_batching.dispatch_when_free", "bentoml._internal.marshal.dispatcher", "Optimizer",
           "64b6c86fa0a5bdba49991820544f57a99f4e186c7a100dd6c7f2b0d04db8bbe6"),
    Target("bentoml_batching.dispatch_when_free", "bentoml._internal.marshal.dispatcher", "CorkDispatcher",
           "c1a03b6e639e747c883d194c80649eabb1e3710a4467151dccf6548c66dda897"),
    Target("bentoml_batching.wake_on_release", "bentoml._internal.marshal.dispatcher", "CorkDispatcher",
           "c1a03b6e639e747c883d194c80649eabb1e3710a4467151dccf6548c66dda897"),
    Target("bentoml_batching.wake_on_release", "bentoml._internal.marshal.dispatcher", "NonBlockSema",
           "d35ae61776f2e3d96cdac0a13c8721c02bef0523aaa0fb11e77dfd4b60c7313b"),
    Target("circus_arbiter.keep_runner_sockets_until_stopped", "bentoml._internal.utils.circus", "Arbiter",
           "8950f69018ed2d075a2ad5f13e3a272e8e20f8c8ae3d4609d083212b39928361"),
    Target("circus_arbiter.keep_runner_sockets_until_stopped", "circus.arbiter", "Arbiter.stop",
           "10180d3605cc0eccadb2dc506ab3c55783020c122d73a36cfe00b199dd7fa993"),
    Target("circus_arbiter.keep_runner_sockets_until_stopped", "circus.arbiter",
           "Arbiter.stop_controller_and_close_sockets",
           "64b22cd160be3e0275403cf809321f34c6a92d538220d7c9751ac8a10167841c"),
    Target("circus_arbiter.keep_runner_sockets_until_stopped", "_bentoml_impl.server.serving", "serve_http",
           "064520b67937911135bca5b173a493865690c3e9e5d739601f01df38ebf0d1e6"),
    Target("uvicorn_httptools.limit_request_heads", "uvicorn.config", "HTTP_PROTOCOLS",
           "7ab42f7685d8ea87328180ec12c3875176b461a1c68cfb5541aa499a8a45a224"),
    Target("uvicorn_httptools.limit_request_heads", _HTTPTOOLS, "HttpToolsProtocol",
           "ae3ad6c5410895e2ddf3065e563328b68a886cd0e514701cc2abe2ae7c1d4000"),
    # The head and keep-alive timeouts: uvicorn's keep-alive timer (armed in on_response_complete,
    # cancelled by data_received, length from __init__'s timeout_keep_alive) and the cycle's close
    # after a response when keep_alive is false.
    Target("uvicorn_httptools.limit_request_heads", _HTTPTOOLS, "HttpToolsProtocol.__init__",
           "d5fa7df7a7fc6bdfc0ef04138c476a8aab6703ac365da419763cef566a32aa81"),
    Target("uvicorn_httptools.limit_request_heads", _HTTPTOOLS, "HttpToolsProtocol.data_received",
           "4344ff8569ed38be2c424a12067b0d118e838c0e71ef41b142360512d5c25565"),
    Target("uvicorn_httptools.limit_request_heads", _HTTPTOOLS, "HttpToolsProtocol.on_response_complete",
           "ca5f13dad87ab8739c4334677ef723a0adacffb407b57612ccc011398c221075"),
    Target("uvicorn_httptools.limit_request_heads", _HTTPTOOLS, "HttpToolsProtocol.timeout_keep_alive_handler",
           "e9a4938ca2920be4f0a98d1be5ff59edeeb13c6c98624637488933ae3581e7ec"),
    Target("uvicorn_httptools.limit_request_heads", _HTTPTOOLS, "RequestResponseCycle.send",
           "1353b43763cb14d450633937a013a488710a5dd2c455bc1667fa604f748e084b"),
    # Refusing an upgrade to a protocol not served, before the app runs (HeadLimitedProtocol.on_headers_complete).
    Target("uvicorn_httptools.limit_request_heads", _HTTPTOOLS, "HttpToolsProtocol.on_headers_complete",
           "c713423e2fb6aa9dce85d23a9934a66399c62d62e616f959d328bff2b90da3e1"),
    Target("uvicorn_httptools.limit_request_heads", _HTTPTOOLS, "HttpToolsProtocol._get_upgrade",
           "cb21def75e9f4fb1127964b76b35be52c31fe0467d2146d19e2c122dde6e016a"),
    Target("uvicorn_httptools.limit_request_heads", _HTTPTOOLS, "HttpToolsProtocol._should_upgrade",
           "9238465204aa4122894396d34940cabae95f81a26bb6c9e2fc14bf72309d1dfd"),
    # A client's FIN: uvicorn's eof_received lets the transport close (the request sees its client gone through
    # connection_lost); HeadLimitedProtocol.eof_received keeps it open to answer a half-closed client when hang-ups
    # are not cancelled.
    Target("uvicorn_httptools.limit_request_heads", _HTTPTOOLS, "HttpToolsProtocol.eof_received",
           "f4dfb06a79ddcba0ac10c4d4f70e45b0df493178ef5bb6a65f2f77972e07ec69"),
    Target("uvicorn_httptools.limit_request_heads", _HTTPTOOLS, "HttpToolsProtocol.connection_lost",
           "c5567cca5922d934fbd4dd5e9c694d38bd832052e858a384e0e71618fbac030b"),
    # Replaced: uvicorn's plain-text 400 for bytes the parser refuses (a JSON malformed_request instead).
    Target("uvicorn_httptools.limit_request_heads", _HTTPTOOLS, "HttpToolsProtocol.send_400_response",
           "62719a7bb676f7ad062d22d296fe10ab3899d45530d932524a5b1cfbed745a34"),
    # Trailer fields of a chunked body are dropped (HeadLimitedProtocol.on_header): uvicorn appends every field
    # llhttp reports, after the head too, to the list the ASGI scope holds as its headers.
    Target("uvicorn_httptools.limit_request_heads", _HTTPTOOLS, "HttpToolsProtocol.on_header",
           "a5fcba108a221bc7abdf9329bcc32f4a5df859e039cffdf2c60c5e0d6f1cc89a"),
    # Nothing unread keeps a connection: the trailer section is counted between a chunk's size line and its data
    # (on_body) or the message's end (on_message_complete); past the bound the app's cycle is ended as at a hang-up
    # (receive answers http.disconnect, send drops); the rest of an answered body ends the connection.
    Target("uvicorn_httptools.limit_request_heads", _HTTPTOOLS, "HttpToolsProtocol.on_body",
           "f10f577730cd2e961a50d5bf4107e6c5891acdc73430cc669e336e0c38344038"),
    Target("uvicorn_httptools.limit_request_heads", _HTTPTOOLS, "HttpToolsProtocol.on_message_complete",
           "ca6a0254d3b3f82df87482ab6ee133f6ca5b9eea75ea0fb15042bc21162f7e3b"),
    Target("uvicorn_httptools.limit_request_heads", _HTTPTOOLS, "RequestResponseCycle.receive",
           "b717688fddd64e7b385e1883c4c0ba200248b2799c608ee23d73995b33001f97"),
    # An answer started while its body is still arriving says connection: close (EarlyAnswerCycle: the cycle made
    # in on_headers_complete takes its class; more_body from __init__ until on_message_complete; send writes the
    # header when keep_alive is false).
    Target("uvicorn_httptools.limit_request_heads", _HTTPTOOLS, "RequestResponseCycle.__init__",
           "5a7283a0be2bf49f60c083a7c5f45b15c1c78c3026d678354426dcafc2e24300"),
    Target("uvicorn_httptools.stamp_arrivals", _HTTPTOOLS, "HttpToolsProtocol.on_message_begin",
           "8b027723aca379722d73c79e47b4d65ea5bf8c977a6706939a00209b7ae5c912"),
    # A write refused because the client's connection closed before uvicorn marked the cycle disconnected.
    Target("uvicorn_cycle.connection_closed", _HTTPTOOLS, "RequestResponseCycle.__init__",
           "5a7283a0be2bf49f60c083a7c5f45b15c1c78c3026d678354426dcafc2e24300"),
    Target("uvicorn_cycle.connection_closed", _HTTPTOOLS, "RequestResponseCycle.send",
           "1353b43763cb14d450633937a013a488710a5dd2c455bc1667fa604f748e084b"),
    Target("uvicorn_cycle.connection_closed", "uvicorn.protocols.http.h11_impl", "RequestResponseCycle.__init__",
           "e7e76bfeb3573aea514f1a64154f6f1a99c7a2a8ff94f62cf95a96b83d04413b"),
    Target("uvicorn_cycle.connection_closed", "uvicorn.protocols.http.h11_impl", "RequestResponseCycle.send",
           "911ac3ec8826c66bf2f5aa1fb5f2550eb40a2352713033a57af6ad12f2d54de1"),
    # A runner's batch calls answered in front of BentoML's app (bentoml_runner_calls): the steps of its endpoint (parse,
    # batch_infer, answer and headers, the errors), the routes and middleware stack it recognises, the series of
    # BentoML's runner metrics middleware and what it writes into them per call.
    Target("bentoml_runner_calls.lean_batch_routes", _APP, "ServiceAppFactory.api_endpoint",
           "bb5c915a262dfc59e4e7d01c59191067147b7b8101b9f32d89c8419453ae014d"),
    Target("bentoml_runner_calls.lean_batch_routes", _APP, "ServiceAppFactory.api_endpoint_wrapper",
           "1d06f550c70e9698e988383e540a00dcc389337cdc58bbd7fa3ddebf5c84d850"),
    Target("bentoml_runner_calls.lean_batch_routes", _APP, "ServiceAppFactory.batch_infer",
           "7762fbcf351231a0a2d8be38cdc7885a9abf554e2a21ffaed779be4f2d78e917"),
    Target("bentoml_runner_calls.lean_batch_routes", _APP, "ServiceAppFactory.routes",
           "f395f8e8a31a078b14aad8ef2e9d5969a79612d197925672b1f6fc2f9434476a"),
    Target("bentoml_runner_calls.lean_batch_routes", _APP, "ServiceAppFactory._add_response_headers",
           "330553c60caa54ac74e1240b40a06a1e0d7b58999768e7174ac283ed8923c4e7"),
    Target("bentoml_runner_calls.lean_batch_routes", _APP, "ServiceAppFactory.middlewares",
           "f5a8c8a75d40a63816792ea8c063b489fdd59494c0598ac42c0f12fee0ef7261"),
    Target("bentoml_runner_calls.lean_batch_routes", "bentoml._internal.server.base_app", "BaseAppFactory.middlewares",
           "f9feb08b021bc94a32b7eeab51efacd6edfd6f3ed1b3040c7b51e5629acc242f"),
    Target("bentoml_runner_calls.lean_batch_routes", "_bentoml_sdk.io_models", "IOMixin.to_http_response",
           "e7b1f2bcdfc2b084b5494b49f2f28dd6d847870e9aede361b6ac8a4c546dd77f"),
    Target("bentoml_runner_calls.lean_batch_routes", "_bentoml_sdk.io_models", "IOMixin.from_http_request",
           "877c4bc331b03a2a3f12eafe14138fa13e98e548b173255df0502bf6820262ff"),
    Target("bentoml_runner_calls.lean_batch_routes", "_bentoml_impl.serde", "Serde.parse_request",
           "22b291761f005892e49a911ee2a82e7985ab940728a2fa7114a977d9db587700"),
    Target("bentoml_runner_calls.lean_batch_routes", "_bentoml_impl.serde", "PickleSerde",
           "28260e17b791ac72def6312794591c4d3afa6748d9460f1036bc3ccd097a6c91"),
    Target("bentoml_runner_calls.lean_batch_routes", _INSTRUMENTS, "RunnerTrafficMetricsMiddleware.__call__",
           "048dcbd5af3f43785785fce4b93bc1f020cf812fbf8c22ab7985919f692c678a"),
    Target("bentoml_runner_calls.lean_batch_routes", _INSTRUMENTS, "RunnerTrafficMetricsMiddleware._setup",
           "7c7f68f0ea6ad5a65390d95e4e3bdd4c4c9c479a89ec49d327aaeaad75ac336c"),
    Target("uvicorn_app.serve_behind_bound", "uvicorn.config", "Config.load",
           "18b38398dc8c3478e90b9ef737d1f21a49f0303af365c2b0aaa81e0ab8f4c335"),
    # Not patched: the runner calls' wire format, which rampart.runner_client builds and reads with these.
    Target("bentoml_wire.RunnerWire", _HTTP_CLIENT, "HTTPClient._build_request",
           "abae96318ffa881d41c92de4690cec554d53564cd2f07b927235606e6e0e1e53"),
    Target("bentoml_wire.RunnerWire", _HTTP_CLIENT, "AsyncHTTPClient._call",
           "999bf119bec512cc73cacc6259577fbb89d64d69a17430d8b87c4dca9bc38257"),
    Target("bentoml_wire.RunnerWire", _HTTP_CLIENT, "AsyncHTTPClient._parse_response",
           "e9009fe40990ae55e7d4f023f96cfd106361cf195a3894fde19a80e66bd15dba"),
    Target("bentoml_wire.RunnerWire", _HTTP_CLIENT, "HTTPClient._deserialize_output",
           "b032f9778d919a7ff3c6c2a72ae19f9da7ba33cab1133b9579141d23c3529234"),
    Target("bentoml_wire.RunnerWire", "_bentoml_impl.client.base", "map_exception",
           "f29ee5f4590834fb1c5e8f21a638f68453f18ad79011aac83d8fe0f5cb3116b7"),
    Target("bentoml_wire.RunnerWire", "_bentoml_impl.serde", "PickleSerde",
           "28260e17b791ac72def6312794591c4d3afa6748d9460f1036bc3ccd097a6c91"),
    Target("bentoml_wire.runner_address", _HTTP_CLIENT, "HTTPClient._make_client",
           "d452d902a704b486ff697621ea6a67aa58f34662a664278fe9d0b2446a57d6a2"),
)
