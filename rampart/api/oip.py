"""The Open Inference Protocol v2 (KServe v2 / Triton HTTP/REST) in front of Rampart's pipeline.

Routes (``routes()``; ``{name}`` is ``rampart``, the served pipeline):

- ``GET /v2``: server metadata ``{name, version, extensions}``;
- ``GET /v2/health/live``, ``GET /v2/health/ready``, ``GET /v2/models/{name}/ready``;
- ``GET /v2/models/{name}``: model metadata (-1 for a variable dimension);
- ``GET /v2/models/{name}/config``: the Triton model configuration ``perf_analyzer`` reads;
- ``POST /v2/models/{name}/infer``: JSON, or the binary tensor data extension both ways.

Every image of an inference request goes through ``Classifier.classify``, the call
``/classify`` makes: the same decode, caps, admission, deadline and fallback chain.
The body is read with ``rampart.api.http.read_body`` under ``/classify_batch``'s byte cap
(``max_batch_images`` × (``max_body_bytes`` + multipart overhead)) and within the
deadline, after ``Classifier.check_capacity`` (so shedding still costs nothing); each
image is then held to ``max_body_bytes``.

Tensors (names as in ``model_metadata``):

- input ``IMAGE``, BYTES, shape ``[N]`` (or ``[N, 1]``): one encoded image per element.
  In the binary extension each element is Triton's length-prefixed bytes; in JSON each
  element is the image base64-encoded (RFC 4648), since a JSON string cannot carry
  raw image bytes.
- input ``PIXELS``, UINT8, shape ``[N, H, W, 3]``: raw RGB pixels, sent instead of ``IMAGE``;
  each image is wrapped losslessly as a BMP and then takes exactly the same path.
- outputs ``LABELS`` (BYTES), ``SCORES`` (FP32), ``CLASS_INDICES`` (INT64), each ``[N, top_k]``,
  best first. An image answered by no model (``no_model_available``, ``deadline_exceeded``)
  gets the padding row: label ``""``, score 0, index -1.

Request ``parameters``: ``top_k`` (1..20, default 5), ``deadline_ms`` (same rules as the
``X-Deadline-Ms`` header, counted from the request's arrival; Triton's ``timeout`` in µs is
read the same way), ``priority`` (``"high"``/``"normal"``, or Triton's integers: 1 high,
0 and 2 normal). Response ``parameters``: ``request_id``, ``degraded`` (any image degraded),
``degraded_reason`` (one reason per image, comma-separated, ``""`` for a full answer),
``needs_review``, ``models`` (the answering model per image, comma-separated), ``routes``
(each image's ``route`` as on ``/classify``: ``primary_first`` or a cascade route, ``""``
when no model answered; comma-separated) and the
timings ``decode_ms``, ``queue_ms``, ``inference_ms``, ``total_ms`` (the slowest image's).

Errors are the protocol's ``{"error": "<code>: <message>"}`` with Rampart's status codes
(see ``rampart.errors``): one bad image fails the whole request, and the message names
its index (``image 3: ...``). ``Retry-After`` comes with 429 as on ``/classify``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import logging
import math
import struct
import time
from dataclasses import dataclass
from importlib.metadata import version as package_version
from typing import Any, Callable, Protocol

import numpy as np
from PIL import Image
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rampart.api import http
from rampart.config import Settings
from rampart.overload.deadline import Deadline
from rampart.errors import EmptyBody, InternalError, InvalidParameter, Overloaded, PayloadTooLarge, RampartError

__all__ = [
    "MODEL_NAME",
    "IMAGE",
    "PIXELS",
    "LABELS",
    "SCORES",
    "CLASS_INDICES",
    "InferRequest",
    "HEADER_LENGTH",
    "parse_infer_request",
    "encode_infer_response",
    "error_response",
    "serialize_bytes",
    "deserialize_bytes",
    "model_metadata",
    "model_config",
    "routes",
]

logger = logging.getLogger("rampart.api.oip")

#: The served model: the whole pipeline (primary, fallback, cache, static answer).
MODEL_NAME = "rampart"
IMAGE, PIXELS = "IMAGE", "PIXELS"
LABELS, SCORES, CLASS_INDICES = "LABELS", "SCORES", "CLASS_INDICES"
OUTPUT_DATATYPES = {LABELS: "BYTES", SCORES: "FP32", CLASS_INDICES: "INT64"}
#: Header of the binary tensor data extension: the length of the JSON part of the body.
HEADER_LENGTH = "Inference-Header-Content-Length"
#: ``GET /v2``'s server version (the serving framework's) and extensions (Triton's names).
SERVER_VERSION = f"bentoml-{package_version('bentoml')}"
EXTENSIONS = ["binary_tensor_data", "model_configuration"]


class Backend(Protocol):
    """What the routes need from the app's state (``rampart.api.app.AppState``)."""

    classifier: Any  # rampart.pipeline.Classifier
    lifecycle: Any  # rampart.api.lifecycle.Lifecycle

    def loop_lag_ms(self) -> float: ...

    def ready(self) -> bool: ...


@dataclass
class InferRequest:
    """A parsed ``/infer`` body.

    ``images``: encoded images, one per batch element (``PIXELS`` already wrapped as BMP);
    ``parameters``: the request's ``parameters`` object; ``outputs``: requested output
    names with their ``binary_data`` flag, or None for all; ``binary_output``: the
    request-wide ``binary_data_output`` flag.
    """

    id: str | None
    images: list[bytes]
    parameters: dict
    outputs: list[tuple[str, bool | None]] | None
    binary_output: bool


def serialize_bytes(elements: list[bytes]) -> bytes:
    """Triton's binary form of a BYTES tensor: each element as a 4-byte little-endian length, then its bytes."""
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def deserialize_bytes(blob: bytes) -> list[bytes]:
    """The elements of a BYTES tensor in Triton's binary form; ``InvalidParameter`` if the framing is broken."""
    elements, offset = [], 0
    while offset < len(blob):
        if offset + 4 > len(blob):
            raise InvalidParameter("BYTES tensor data ends inside a 4-byte length prefix")
        (size,) = struct.unpack_from("<I", blob, offset)
        offset += 4
        if offset + size > len(blob):
            raise InvalidParameter(f"BYTES element of {size} bytes runs past the end of its tensor data")
        elements.append(blob[offset:offset + size])
        offset += size
    return elements


def _flatten(data: Any) -> list:
    """Row-major flattening of a JSON tensor's ``data`` (flat or nested lists)."""
    if not isinstance(data, list):
        return [data]
    if all(not isinstance(item, list) for item in data):
        return data
    return [leaf for item in data for leaf in _flatten(item)]


def _shape(tensor: dict) -> list[int]:
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise InvalidParameter(f"input {tensor.get('name')!r}: 'shape' must be a list of non-negative integers")
    return shape


def _pixels_as_bmp(pixels: np.ndarray) -> list[bytes]:
    """Each H×W×3 uint8 image of an N×H×W×3 array as a BMP file (lossless; decoded like any upload)."""
    files = []
    for image in pixels:
        buffer = io.BytesIO()
        Image.fromarray(image, "RGB").save(buffer, format="BMP")
        files.append(buffer.getvalue())
    return files


def _image_elements(tensor: dict, blob: bytes | None, max_image_bytes: int) -> list[bytes]:
    """The encoded images of an ``IMAGE`` tensor (binary or base64 JSON elements)."""
    if tensor.get("datatype") != "BYTES":
        raise InvalidParameter(f"input {IMAGE!r} must be BYTES, got {tensor.get('datatype')!r}")
    shape = _shape(tensor)
    if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1):
        raise InvalidParameter(f"input {IMAGE!r} must have shape [N] or [N, 1], got {shape}")
    if blob is not None:
        elements = deserialize_bytes(blob)
    else:
        elements = []
        for index, item in enumerate(_flatten(tensor.get("data", []))):
            if not isinstance(item, str):
                raise InvalidParameter(f"{IMAGE}[{index}]: in JSON each image must be a base64 string")
            if len(item) > 4 * -(-max_image_bytes // 3):  # the base64 length of max_image_bytes
                raise PayloadTooLarge(f"{IMAGE}[{index}]: the image is over the limit of {max_image_bytes} bytes")
            try:
                elements.append(base64.b64decode(item, validate=True))
            except (binascii.Error, ValueError):
                raise InvalidParameter(f"{IMAGE}[{index}]: not valid base64 (RFC 4648)") from None
    if len(elements) != shape[0]:
        raise InvalidParameter(f"input {IMAGE!r} has shape {shape} but carries {len(elements)} elements")
    for index, data in enumerate(elements):
        if len(data) > max_image_bytes:
            raise PayloadTooLarge(f"{IMAGE}[{index}]: the image is {len(data)} bytes; the limit is {max_image_bytes}")
    return elements


def _pixel_images(tensor: dict, blob: bytes | None) -> list[bytes]:
    """The images of a ``PIXELS`` tensor, each wrapped as BMP."""
    if tensor.get("datatype") != "UINT8":
        raise InvalidParameter(f"input {PIXELS!r} must be UINT8, got {tensor.get('datatype')!r}")
    shape = _shape(tensor)
    if len(shape) != 4 or shape[3] != 3 or 0 in shape[1:3]:
        raise InvalidParameter(f"input {PIXELS!r} must have shape [N, H, W, 3] with H, W >= 1, got {shape}")
    count = math.prod(shape)  # Python integers: no overflow for hostile shapes
    if blob is not None:
        if len(blob) != count:
            raise InvalidParameter(f"input {PIXELS!r} of shape {shape} needs {count} bytes, got {len(blob)}")
        pixels = np.frombuffer(blob, dtype=np.uint8)
    else:
        try:
            pixels = np.asarray(_flatten(tensor.get("data", [])), dtype=np.int64)
        except (TypeError, ValueError):
            raise InvalidParameter(f"input {PIXELS!r}: 'data' must be integers in 0..255") from None
        if pixels.size != count or (pixels.size and (pixels.min() < 0 or pixels.max() > 255)):
            raise InvalidParameter(f"input {PIXELS!r} of shape {shape} needs {count} integers in 0..255")
        pixels = pixels.astype(np.uint8)
    return _pixels_as_bmp(pixels.reshape(shape))


def parse_infer_request(body: bytes, header_length: str | None, max_image_bytes: int) -> InferRequest:
    """Parse an ``/infer`` body: JSON, or JSON of ``header_length`` bytes followed by binary tensor data.

    Raises ``InvalidParameter`` (422) for anything that is not a well-formed request
    with exactly one of ``IMAGE`` / ``PIXELS``, ``EmptyBody`` (400) for zero images and
    ``PayloadTooLarge`` (413) for a base64 image over ``max_image_bytes``.
    """
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise InvalidParameter(f"{HEADER_LENGTH} must be a byte count within the body, got {header_length[:32]!r}")
        split = int(header_length)
        header_bytes, binary = body[:split], memoryview(body)[split:]
    else:
        header_bytes, binary = body, memoryview(b"")
    try:
        header = json.loads(header_bytes)
    except (ValueError, RecursionError) as exc:  # RecursionError: hostile nesting
        raise InvalidParameter(f"the inference request is not valid JSON: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list):
        raise InvalidParameter("the inference request must be a JSON object with an 'inputs' list")
    parameters = header.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidParameter("'parameters' must be a JSON object")

    images: list[bytes] | None = None
    offset = 0
    for tensor in header["inputs"]:
        if not isinstance(tensor, dict):
            raise InvalidParameter("each input must be a JSON object")
        blob = None
        size = (tensor.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise InvalidParameter(f"input {tensor.get('name')!r}: binary_data_size {size!r} runs past the body")
            blob = bytes(binary[offset:offset + size])
            offset += size
        name = tensor.get("name")
        if name not in (IMAGE, PIXELS):
            raise InvalidParameter(f"unknown input {name!r}; the model takes {IMAGE!r} (BYTES) or {PIXELS!r} (UINT8)")
        if images is not None:
            raise InvalidParameter(f"send exactly one of {IMAGE!r} and {PIXELS!r}")
        images = _image_elements(tensor, blob, max_image_bytes) if name == IMAGE else _pixel_images(tensor, blob)
    if images is None:
        raise InvalidParameter(f"the request has no input; send {IMAGE!r} (BYTES) or {PIXELS!r} (UINT8)")
    if offset != len(binary):
        raise InvalidParameter(f"{len(binary) - offset} bytes of binary data are not claimed by any input")
    if not images:
        raise EmptyBody(f"the {IMAGE!r} tensor has no elements")

    outputs = None
    if header.get("outputs") is not None:
        if not isinstance(header["outputs"], list):
            raise InvalidParameter("'outputs' must be a list")
        outputs = []
        for output in header["outputs"]:
            name = output.get("name") if isinstance(output, dict) else None
            if name not in OUTPUT_DATATYPES:
                raise InvalidParameter(f"unknown output {name!r}; the model has {sorted(OUTPUT_DATATYPES)}")
            params = output.get("parameters") or {}
            if params.get("classification"):
                raise InvalidParameter("the classification extension is not supported; read LABELS/SCORES")
            outputs.append((name, params.get("binary_data")))
    binary_output = parameters.get("binary_data_output", False)
    if not isinstance(binary_output, bool):
        raise InvalidParameter("'binary_data_output' must be true or false")
    request_id = header.get("id")
    return InferRequest(None if request_id is None else str(request_id), images, parameters, outputs, binary_output)


class _Parameters:
    """Request parameters seen through the interface ``rampart.api.http``'s parsers read (headers, query).

    So ``top_k``, ``deadline_ms`` and ``priority`` get exactly the checks (and defaults)
    of ``?top_k``, ``X-Deadline-Ms`` and ``X-Priority`` on ``/classify``.
    """

    def __init__(self, request: Request, parameters: dict) -> None:
        headers = {key: value for key, value in request.headers.items()}
        if "deadline_ms" in parameters:
            headers["x-deadline-ms"] = _text(parameters["deadline_ms"], "deadline_ms")
        elif "timeout" in parameters:  # Triton's per-request timeout, in microseconds
            headers["x-deadline-ms"] = str(_number(parameters["timeout"], "timeout") / 1000.0)
        if "priority" in parameters:
            headers["x-priority"] = _priority(parameters["priority"])
        self.headers = headers
        self.scope = request.scope  # the arrival time (``rampart.api.arrival``) lives there
        self.sets_deadline = "deadline_ms" in parameters or "timeout" in parameters
        self.query_params = dict(request.query_params)
        if "top_k" in parameters:
            self.query_params["top_k"] = _text(parameters["top_k"], "top_k")


def _text(value: Any, name: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidParameter(f"parameter {name} must be a number, got {json.dumps(value)[:32]}")
    return str(value)


def _number(value: Any, name: str) -> float:
    try:
        return float(_text(value, name))
    except ValueError:
        raise InvalidParameter(f"parameter {name} must be a number, got {str(value)[:32]!r}") from None


def _priority(value: Any) -> str:
    """Triton's integer levels (1 high; 0 default and 2 normal) or Rampart's words."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value in (0, 1, 2):
            return "high" if value == 1 else "normal"
        raise InvalidParameter(f"parameter priority must be 0, 1 (high) or 2 (normal), got {value}")
    if isinstance(value, str):
        return value
    raise InvalidParameter(f"parameter priority must be 'high', 'normal' or 0..2, got {json.dumps(value)[:32]}")


def _rows(results: list[dict], top_k: int) -> dict[str, np.ndarray]:
    """The output tensors of N answers: [N, top_k] arrays, padded for answers without labels."""
    labels = np.full((len(results), top_k), b"", dtype=object)
    scores = np.zeros((len(results), top_k), dtype=np.float32)
    indices = np.full((len(results), top_k), -1, dtype=np.int64)
    for row, result in enumerate(results):
        for column, entry in enumerate(result["labels"][:top_k]):
            labels[row, column] = entry["label"].encode("utf-8")
            scores[row, column] = entry["score"]
            indices[row, column] = entry["index"]
    return {LABELS: labels, SCORES: scores, CLASS_INDICES: indices}


def _response_parameters(results: list[dict], request_id: str) -> dict:
    timings = [result["timings_ms"] for result in results]
    return {
        "request_id": request_id,
        "degraded": any(result["degraded"] for result in results),
        "degraded_reason": ",".join(result["degraded_reason"] or "" for result in results),
        "needs_review": any(result["needs_review"] for result in results),
        "models": ",".join((result["model"] or {}).get("name", "") for result in results),
        "routes": ",".join(result.get("route") or "" for result in results),
        **{f"{stage}_ms": max(t[stage] for t in timings) for stage in ("decode", "queue", "inference", "total")},
    }


def encode_infer_response(parsed: InferRequest, results: list[dict], top_k: int, request_id: str,
                          model_version: str) -> Response:
    """The ``/infer`` answer for ``results`` (``Classifier.classify`` bodies, one per image).

    Outputs are binary (with ``Inference-Header-Content-Length``) where the request asked
    for it, per output (``binary_data``) or for all (``binary_data_output``); JSON otherwise.
    """
    tensors = _rows(results, top_k)
    wanted = parsed.outputs if parsed.outputs is not None else [(name, None) for name in OUTPUT_DATATYPES]
    outputs, blobs = [], []
    for name, binary in wanted:
        array = tensors[name]
        entry = {"name": name, "datatype": OUTPUT_DATATYPES[name], "shape": list(array.shape)}
        if binary if binary is not None else parsed.binary_output:
            blob = serialize_bytes(list(array.ravel())) if name == LABELS else array.astype(array.dtype.newbyteorder("<")).tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = [b.decode("utf-8") for b in array.ravel()] if name == LABELS else array.ravel().tolist()
        outputs.append(entry)
    body = {"model_name": MODEL_NAME, "model_version": model_version,
            "parameters": _response_parameters(results, request_id), "outputs": outputs}
    if parsed.id is not None:
        body["id"] = parsed.id
    headers = {"X-Request-Id": request_id}
    if not blobs:
        return JSONResponse(body, headers=headers)
    header = json.dumps(body, separators=(",", ":")).encode("utf-8")
    headers[HEADER_LENGTH] = str(len(header))
    return Response(header + b"".join(blobs), media_type="application/octet-stream", headers=headers)


def error_response(error: RampartError, request_id: str) -> JSONResponse:
    """The protocol's error body ``{"error": "<code>: <message>"}`` with Rampart's status (and ``Retry-After``
    on 429 and 503)."""
    headers = {"X-Request-Id": request_id}
    retry_after_s = getattr(error, "retry_after_s", None)  # Overloaded, Unavailable
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(retry_after_s)))
    return JSONResponse({"error": f"{error.code}: {error.message}"}, status_code=error.status, headers=headers)


def model_metadata(version: str) -> dict:
    """``GET /v2/models/rampart``: name, versions, platform and tensors (-1: variable size)."""
    return {
        "name": MODEL_NAME,
        "versions": [version],
        "platform": "rampart",
        "inputs": [
            {"name": IMAGE, "datatype": "BYTES", "shape": [-1]},
            {"name": PIXELS, "datatype": "UINT8", "shape": [-1, -1, -1, 3]},
        ],
        "outputs": [{"name": name, "datatype": datatype, "shape": [-1, -1]}
                    for name, datatype in OUTPUT_DATATYPES.items()],
    }


def model_config(settings: Settings, version: str) -> dict:
    """``GET /v2/models/rampart/config``: a Triton model configuration (JSON form) for ``perf_analyzer``.

    ``max_batch_size`` is ``max_batch_images`` (images per request); ``dynamic_batching``
    describes the primary's batcher (``primary_max_batch_size``, ``primary_queue_delay_ms``),
    two priority levels (1 high, 2 normal) and the default deadline as queue timeout.
    The ``IMAGE`` dims are ``[1]`` reshaped to ``[]``: Triton's way of a ``[N]`` input.
    """
    return {
        "name": MODEL_NAME,
        "platform": "rampart",
        "backend": "rampart",
        "version_policy": {"specific": {"versions": [version]}},
        "max_batch_size": settings.max_batch_images,
        "input": [
            {"name": IMAGE, "data_type": "TYPE_STRING", "format": "FORMAT_NONE", "dims": [1],
             "reshape": {"shape": []}, "optional": True},
            {"name": PIXELS, "data_type": "TYPE_UINT8", "format": "FORMAT_NHWC", "dims": [-1, -1, 3],
             "optional": True},
        ],
        "output": [{"name": name, "data_type": "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}",
                    "dims": [-1]} for name, datatype in OUTPUT_DATATYPES.items()],
        "dynamic_batching": {
            "preferred_batch_size": [settings.primary_max_batch_size],
            "max_queue_delay_microseconds": int(settings.primary_queue_delay_ms * 1000),
            "priority_levels": 2,
            "default_priority_level": 2,
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": int(settings.default_deadline_ms * 1000),
                "allow_timeout_override": True,
            },
        },
        "parameters": {
            "max_deadline_ms": {"string_value": str(settings.max_deadline_ms)},
            "max_body_bytes": {"string_value": str(settings.max_body_bytes)},
        },
    }


def routes(settings: Settings, backend: Backend, account: Callable[..., None]) -> list[Route]:
    """The protocol's Starlette routes.

    ``backend`` is the app's state (classifier, lifecycle, loop lag, readiness:
    ``rampart.api.app.AppState``); ``account(request, request_id, high, started, status,
    code, **extra)`` counts and logs each inference answer (``rampart.api.app.finished``),
    so ``/v2`` traffic shows in the same metrics and access log.
    """

    def version() -> str:
        return backend.classifier.primary.endpoint.version

    def unknown_model(request: Request) -> JSONResponse | None:
        name = request.path_params["name"]
        wanted = request.path_params.get("version")
        if name != MODEL_NAME or (wanted is not None and wanted != version()):
            asked = name if wanted is None else f"{name} version {wanted}"
            return JSONResponse({"error": f"unknown model {asked!r}; this server serves {MODEL_NAME!r} "
                                          f"version {version()!r}"}, status_code=404)
        return None

    async def server_metadata(request: Request) -> JSONResponse:
        return JSONResponse({"name": MODEL_NAME, "version": SERVER_VERSION, "extensions": EXTENSIONS})

    async def live(request: Request) -> JSONResponse:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> JSONResponse:
        is_ready = backend.ready()
        return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 503)

    async def model_ready(request: Request) -> JSONResponse:
        missing = unknown_model(request)
        if missing is not None:
            return missing
        is_ready = backend.ready()
        return JSONResponse({"name": MODEL_NAME, "ready": is_ready}, status_code=200 if is_ready else 503)

    async def metadata(request: Request) -> JSONResponse:
        return unknown_model(request) or JSONResponse(model_metadata(version()))

    async def config(request: Request) -> JSONResponse:
        return unknown_model(request) or JSONResponse(model_config(settings, version()))

    async def infer(request: Request) -> Response:
        started, request_id = time.perf_counter(), http.request_id_of(request)
        try:  # refused (503) before warm-up and during a drain, else counted in flight until answered
            admission = backend.lifecycle.admit()
        except RampartError as exc:
            account(request, request_id, False, started, exc.status, exc.code)
            return error_response(exc, request_id)
        with admission:
            return await admitted_infer(request, started, request_id)

    async def admitted_infer(request: Request, started: float, request_id: str) -> Response:
        high = False
        missing = unknown_model(request)
        if missing is not None:
            return missing
        try:
            lag_ms = backend.loop_lag_ms()
            deadline = http.parse_deadline(request, settings, lag_ms)
            high = http.parse_priority(request)
            classifier = backend.classifier
            classifier.check_capacity(deadline, high)  # sheds (429) before the body is read
            limit = settings.max_batch_images * (settings.max_body_bytes + http.MULTIPART_OVERHEAD_BYTES)
            body = await http.read_body(request, limit, deadline)  # /classify_batch's cap
            parsed = await asyncio.to_thread(parse_infer_request, body, request.headers.get(HEADER_LENGTH),
                                             settings.max_body_bytes)
            view = _Parameters(request, parsed.parameters)
            top_k = http.parse_top_k(view)
            high = http.parse_priority(view)
            if view.sets_deadline:  # counted from the same arrival as the header's
                deadline = http.parse_deadline(view, settings, lag_ms, deadline.arrival)
            if len(parsed.images) > settings.max_batch_images:
                raise InvalidParameter(f"{len(parsed.images)} images sent; the limit is {settings.max_batch_images}")
            results = await _classify_all(classifier, parsed.images, top_k, deadline, high)
        except Exception as exc:
            if not isinstance(exc, RampartError):
                logger.exception("unexpected failure for request %s", request_id, exc_info=exc)
                exc = InternalError("an unexpected error occurred; see the server log")
            account(request, request_id, high, started, exc.status, exc.code)
            return error_response(exc, request_id)
        response = encode_infer_response(parsed, results, top_k, request_id, version())
        account(request, request_id, high, started, 200, "ok", images=len(results))
        return response

    paths = ["/v2/models/{name}", "/v2/models/{name}/versions/{version}"]
    return [
        Route("/v2", server_metadata, methods=["GET"]),
        Route("/v2/health/live", live, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        *(Route(f"{path}/ready", model_ready, methods=["GET"]) for path in paths),
        *(Route(path, metadata, methods=["GET"]) for path in paths),
        *(Route(f"{path}/config", config, methods=["GET"]) for path in paths),
        *(Route(f"{path}/infer", infer, methods=["POST"]) for path in paths),
    ]


async def _classify_all(classifier: Any, images: list[bytes], top_k: int, deadline: Deadline,
                        high: bool) -> list[dict]:
    """``classifier.classify`` for every image at once; the first failing image (by index) fails the request."""
    answers = await asyncio.gather(*(classifier.classify(data, top_k, deadline, high) for data in images),
                                   return_exceptions=True)
    for index, answer in enumerate(answers):
        if isinstance(answer, RampartError):
            if len(images) > 1:
                answer.message = f"image {index}: {answer.message}"
            raise answer
        if isinstance(answer, BaseException):
            raise answer
    return answers
