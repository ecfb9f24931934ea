"""BentoML 1.4.29's runner-call wire format, reached as BentoML builds and reads it (nothing here is patched).

A call from the entry service to a runner API is, in BentoML's dependency proxy
(``_bentoml_impl.client.http.AsyncHTTPClient._call``): a POST to the API's route with
``Content-Type: application/vnd.bentoml+pickle``, the client's default headers, the
trace context, ``content-length`` and ``buffer-lengths``, and a body that is the API's
input model (``ClientEndpoint.input_spec.from_inputs``) serialised by BentoML's
``PickleSerde`` (pickle protocol 5 with out-of-band buffers). The answer is read back
with the client's own ``_deserialize_output``, and an error status becomes the exception
BentoML's client raises (``map_exception``).

``RunnerWire`` does exactly those steps with BentoML's own objects, so the bytes on the
wire are BentoML's; only the HTTP transport under them is Rampart's
(``rampart.runner_client``). ``tests/unit/test_runner_client.py`` checks the request
against the one BentoML's client builds, and ``rampart.compat.targets`` hashes the
functions used, so an upgrade that changes them is caught.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["RunnerWire", "runner_address"]


def runner_address(remote) -> tuple[str, Any] | None:
    """Where BentoML's async proxy client ``remote`` (``AsyncHTTPClient``) sends its calls: ``("unix", path)``
    for a runner on a Unix socket (``file://`` URL, what ``bentoml serve`` gives every dependency on one host),
    ``("tcp", (host, port))`` for a ``tcp://`` URL, None otherwise (an in-process app, or any other URL)."""
    from urllib.parse import urlparse

    from bentoml._internal.utils.uri import uri_to_path

    url = getattr(remote, "url", "")
    if not isinstance(url, str) or getattr(remote, "app", None) is not None:
        return None
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return "unix", uri_to_path(url)
    if parsed.scheme == "tcp" and parsed.hostname and parsed.port:
        return "tcp", (parsed.hostname, parsed.port)
    return None


class RunnerWire:
    """BentoML's encoding of calls to one runner API and decoding of their answers (module doc).

    ``remote`` is the dependency's ``AsyncHTTPClient`` (``runner.to_async``) and ``api`` the name
    of a batchable API on it (for example ``square``).
    """

    def __init__(self, remote, api: str) -> None:
        from _bentoml_impl.client.base import map_exception

        self.remote = remote
        self.endpoint = remote.endpoints[api]
        self.route = self.endpoint.route
        self.serde = remote.serde
        self._map_exception = map_exception
        self.fixed_headers = {"Content-Type": remote.media_type, **dict(remote.default_headers)}

    def encode(self, items: Sequence[Any]) -> tuple[dict[str, str], list]:
        """The headers (without ``Host``) and body parts (``bytes`` or ``memoryview``) of a call with ``items``,
        built as BentoML's ``_build_request`` builds them."""
        from opentelemetry import propagate

        headers = dict(self.fixed_headers)
        propagate.inject(headers)
        model = self.endpoint.input_spec.from_inputs(list(items))
        payload = self.serde.serialize_model(model)
        headers.update(payload.headers)
        return headers, list(payload.data)

    def decode(self, status: int, headers: dict[str, str], body: bytes) -> Any:
        """The call's output (what BentoML's proxy returns: one result per item) from the runner's answer, or
        the ``BentoMLException`` subclass BentoML's client raises for an error ``status`` (raised)."""
        if status >= 400:
            import httpx

            raise self._map_exception(httpx.Response(status, headers=headers, content=body))
        from _bentoml_impl.serde import Payload

        return self.remote._deserialize_output(Payload((body,), headers), self.endpoint)
