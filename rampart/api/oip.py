"""The Open Inference Protocol v2 (KServe v2 / Triton HTTP/REST) in front of Rampart's pipeline.

Routes (``routes()``; ``{name}`` is ``rampart``, the served pipeline; each also under
``/v2/models/{name}/versions/{version}``):

- ``GET /v2``: server metadata ``{name, version, extensions}``;
- ``GET /v2/health/live``, ``GET /v2/health/ready``, ``GET /v2/models/{name}/ready``;
- ``GET /v2/models/{name}``: model metadata (-1 for a variable dimension);
- ``GET /v2/models/{name}/config``: the Triton model configuration ``perf_analyzer`` reads;
- ``POST /v2/models/{name}/infer``: JSON, or the binary tensor data extension both ways;
  the body may be sent with ``Content-Encoding: gzip`` or ``deflate``;
- ``POST /v2/repository/index``: the model repository index (the one model, read only);
- ``GET /v2/models/stats``, ``GET /v2/models/{name}/stats``: the statistics extension, from
  this API worker's counts of its ``/v2`` inference requests (``InferenceStatistics``).

Every image of an inference request goes through ``Pipeline.classify``, the call
``/classify`` makes: the same decode, caps, admission, deadline and fallback chain.
The body is read with ``rampart.api.http.body_chunks`` under ``/classify_batch``'s byte cap
(``max_batch_images`` × (``max_body_bytes`` + multipart overhead)), decompressed
incrementally under the same cap, within the deadline, after ``Pipeline.check_capacity``
(so shedding still costs nothing); it is parsed in a worker thread within the deadline,
each limit (``Limits``) checked before any tensor is split or converted.

Tensors (names as in ``model_metadata``):

- input ``IMAGE``, BYTES, shape ``[N, 1]`` (or ``[N]``): one encoded image per element.
  In the binary extension each element is Triton's length-prefixed bytes; in JSON each
  element is the image base64-encoded (RFC 4648), since a JSON string cannot carry
  raw image bytes.
- input ``PIXELS``, UINT8, shape ``[N, H, W, 3]``: raw RGB pixels, sent instead of ``IMAGE``;
  each image is wrapped losslessly as a BMP and then takes exactly the same path. In JSON
  at most ``MAX_JSON_VALUES`` values; larger tensors go in the binary extension.
- outputs ``LABELS`` (BYTES), ``SCORES`` (FP32), ``CLASS_INDICES`` (INT64), each ``[N, top_k]``,
  best first. An image answered by no model (``no_model_available``, ``deadline_exceeded``)
  gets the padding row: label ``""``, score 0, index -1.
- per-image outcome outputs, each ``[N, 1]``: ``DEGRADED_REASON`` (BYTES, ``""`` for a full
  answer), ``MODEL`` (BYTES, the answering model's name, ``""`` for none), ``ROUTE`` (BYTES,
  the image's ``route`` as on ``/classify``, ``""`` when no model answered) and
  ``NEEDS_REVIEW`` (BOOL).

Request ``parameters``: ``top_k`` (1..20, default 5), ``deadline_ms`` (same rules as the
``X-Deadline-Ms`` header, counted from the request's arrival; Triton's ``timeout`` in µs is
read the same way), ``priority`` (``"high"``/``"normal"``/``"low"``, or Triton's integers: 1 high,
0 and 2 normal, 3 low). Response ``parameters``: ``request_id``, ``degraded`` (any image degraded),
``needs_review`` (any image) and the timings ``decode_ms``, ``queue_ms``, ``inference_ms``,
``total_ms`` (the slowest image's).

Every error under ``/v2`` is the protocol's ``{"error": "<code>: <message>"}`` (a string)
with Rampart's status codes (see ``rampart.errors``), 404/405 included
(``rampart.api.routing.JSONRouteErrors`` uses ``error_response`` for ``/v2`` paths): one bad
image fails the whole request, and the message names its index (``image 3: ...``).
``Retry-After`` comes with 429 and 503 as on ``/classify``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import io
import itertools
import json
import logging
import math
import struct
import time
import zlib
from dataclasses import dataclass, field
from importlib.metadata import version as package_version
from typing import Any, AsyncIterator, Callable, Protocol

import numpy as np
from PIL import Image
from starlette.datastructures import MutableHeaders, QueryParams
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rampart.api import http
from rampart.api.arrival import hold_body_bytes
from rampart.api.http import JsonResponse
from rampart.config import Settings
from rampart.inputs.pool import BoundedPool, JobTimeout, WorkerDied
from rampart.overload.deadline import Deadline, run_within
from rampart.errors import (DeadlineTooShort, EmptyBody, ImageTooLarge, InternalError, InvalidParameter, MethodNotAllowed,
                            PayloadTooLarge, RampartError, RequestTimeout, UnsupportedFormat)

__all__ = [
    "MODEL_NAME",
    "MODEL_VERSION",
    "IMAGE",
    "PIXELS",
    "LABELS",
    "SCORES",
    "CLASS_INDICES",
    "DEGRADED_REASON",
    "MODEL",
    "ROUTE",
    "NEEDS_REVIEW",
    "TOP_K_OUTPUTS",
    "OUTPUT_DATATYPES",
    "MAX_JSON_VALUES",
    "Limits",
    "InferRequest",
    "InferenceStatistics",
    "HEADER_LENGTH",
    "is_oip_path",
    "parse_infer_request",
    "request_options",
    "read_infer_body",
    "encode_infer_response",
    "error_response",
    "serialize_bytes",
    "deserialize_bytes",
    "model_metadata",
    "model_config",
    "repository_index",
    "routes",
]

logger = logging.getLogger("rampart.api.oip")

#: The served model: the whole pipeline (primary, fallback, cache, static answer), and its one version.
#: Triton's versions are integers, and perf_analyzer reads them as such; the BentoML models behind it
#: (name:version) are in the configuration's ``parameters`` (``model_config``).
MODEL_NAME, MODEL_VERSION = "rampart", "1"
#: The paths an inference request to the served model takes (without and with its version): both go through
#: the in-flight bound and the budget of body bytes (``service.ADMITTED_ROUTES``).
INFER_PATHS = (f"/v2/models/{MODEL_NAME}/infer", f"/v2/models/{MODEL_NAME}/versions/{MODEL_VERSION}/infer")
IMAGE, PIXELS = "IMAGE", "PIXELS"
LABELS, SCORES, CLASS_INDICES = "LABELS", "SCORES", "CLASS_INDICES"
DEGRADED_REASON, MODEL, ROUTE, NEEDS_REVIEW = "DEGRADED_REASON", "MODEL", "ROUTE", "NEEDS_REVIEW"
#: The ``[N, top_k]`` outputs, then the ``[N, 1]`` per-image outcomes; every output's datatype.
TOP_K_OUTPUTS = (LABELS, SCORES, CLASS_INDICES)
OUTPUT_DATATYPES = {LABELS: "BYTES", SCORES: "FP32", CLASS_INDICES: "INT64", DEGRADED_REASON: "BYTES",
                    MODEL: "BYTES", ROUTE: "BYTES", NEEDS_REVIEW: "BOOL"}
#: Header of the binary tensor data extension: the length of the JSON part of the body.
HEADER_LENGTH = "Inference-Header-Content-Length"
#: ``GET /v2``'s server version (the serving framework's) and extensions (Triton's names).
SERVER_VERSION = f"bentoml-{package_version('bentoml')}"
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics"]
#: Values (numbers, strings, ...) the JSON part of a request may hold: 2**20, a 590×590 RGB image in
#: ``PIXELS`` data. Counted as commas before parsing, which bounds the parse's memory (about 10 MB of lists)
#: but not its time: a million long floats or object keys take 0.75-0.9 s (``PARSE_IN_WORKER_BYTES``); larger
#: pixel arrays go in the binary extension (tritonclient's default).
MAX_JSON_VALUES = 1 << 20
#: Shape rank (``PIXELS`` is 4-D), each dimension (Triton's int64 dims) and ``id`` length.
MAX_RANK, MAX_DIMENSION, MAX_ID_CHARS = 4, 2**63 - 1, 256
#: Bytes the JSON part of a request may hold: 64 MiB, Triton's default ``--http-max-input-size``
#: (``HTTP_DEFAULT_MAX_INPUT_SIZE``). ``json.loads`` holds the GIL for the whole parse, 0.13-0.17 s for 64 MiB
#: of whitespace or of one base64 string on the 2-core host but far longer per byte for numbers or keys, so a
#: JSON part over ``PARSE_IN_WORKER_BYTES`` is parsed in a decode worker process, not in the API worker.
MAX_JSON_BYTES = 64 << 20
#: Decompressed bytes produced by one inflate step in a worker thread (zlib releases the GIL while it inflates).
INFLATE_SLICE_BYTES = 1 << 20
#: ``Content-Encoding`` values accepted on ``/infer`` and their zlib ``wbits`` (None: not compressed).
#: ``deflate`` is the zlib format (RFC 9110 §8.4.1.2), which is what tritonclient sends.
ENCODINGS = {"identity": None, "gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
#: Members a gzip body may hold (RFC 1952 allows a series; each costs a step in a worker thread, so they are counted).
MAX_GZIP_MEMBERS = 64
_GZIP_MAGIC = b"\x1f\x8b"
#: A repository index request's body is a small JSON object (``{"ready": true}``) or empty.
MAX_INDEX_BODY_BYTES = 4096


class Backend(Protocol):
    """What the routes need from the app's state (``rampart.api.app.AppState``)."""

    pipeline: Any  # rampart.pipeline.Pipeline
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


def is_oip_path(path: str) -> bool:
    """Whether ``path`` is under ``/v2``, where errors take the protocol's form (``error_response``)."""
    return path == "/v2" or path.startswith("/v2/")


def serialize_bytes(elements: list[bytes]) -> bytes:
    """Triton's binary form of a BYTES tensor: each element as a 4-byte little-endian length, then its bytes."""
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def deserialize_bytes(blob: bytes | memoryview, max_elements: int | None = None) -> list[bytes]:
    """The elements of a BYTES tensor in Triton's binary form.

    ``InvalidParameter`` if the framing is broken or (with ``max_elements``) it holds more
    elements than that: counted as it goes, so a blob of millions of empty elements
    costs no more than ``max_elements`` of them.
    """
    elements, offset = [], 0
    while offset < len(blob):
        if max_elements is not None and len(elements) == max_elements:
            raise InvalidParameter(f"BYTES tensor data holds more than the {max_elements} elements its shape declares")
        if offset + 4 > len(blob):
            raise InvalidParameter("BYTES tensor data ends inside a 4-byte length prefix")
        (size,) = struct.unpack_from("<I", blob, offset)
        offset += 4
        if offset + size > len(blob):
            raise InvalidParameter(f"BYTES element of {size} bytes runs past the end of its tensor data")
        elements.append(bytes(blob[offset:offset + size]))
        offset += size
    return elements


#: Bytes of the BMP file header and BITMAPINFOHEADER that Pillow writes before a 24-bit image's rows.
BMP_HEADER_BYTES = 54


def bmp_bytes(width: int, height: int) -> int:
    """Bytes of the 24-bit BMP ``_pixels_as_bmp`` makes of a ``width`` × ``height`` image: the header and each row
    of 3 bytes a pixel padded to 4 bytes."""
    return BMP_HEADER_BYTES + height * ((width * 3 + 3) // 4 * 4)


def _pixels_as_bmp(pixels: np.ndarray) -> list[bytes]:
    """Each H×W×3 uint8 image of an N×H×W×3 array as a BMP file (lossless; decoded like any upload)."""
    files = []
    for image in pixels:
        buffer = io.BytesIO()
        Image.fromarray(image, "RGB").save(buffer, format="BMP")
        files.append(buffer.getvalue())
    return files


@dataclass(frozen=True)
class Limits:
    """What one ``/infer`` body may carry, checked before any tensor is split or converted.

    ``max_images``: images per request (``max_batch_images``); ``max_image_bytes``: bytes
    per encoded image (``max_body_bytes``); ``max_pixels``: H × W per ``PIXELS`` image
    (``max_pixels``); ``max_json_values``: values the JSON part may hold
    (``MAX_JSON_VALUES``), so that its parse time and memory are bounded by a count;
    ``max_json_bytes``: bytes the JSON part may hold (``MAX_JSON_BYTES``), which bounds its parse time
    however few values it has.
    """

    max_images: int
    max_image_bytes: int
    max_pixels: int
    max_json_values: int = MAX_JSON_VALUES
    max_json_bytes: int = MAX_JSON_BYTES

    @classmethod
    def of(cls, settings: Settings) -> "Limits":
        """The limits ``settings`` give."""
        return cls(settings.inputs.max_batch_images, settings.inputs.max_body_bytes, settings.inputs.max_pixels)


def _json_values_bound(header_bytes: bytes) -> int:
    """An upper bound on the values a JSON text holds: its commas plus one (a C-speed byte count)."""
    return header_bytes.count(b",") + 1


def _refuse_constant(name: str) -> Any:
    raise InvalidParameter(f"the inference request holds {name}, which JSON does not allow")


def _object(value: Any, what: str) -> dict:
    """``value`` when it is a JSON object, ``{}`` for absent/null; else ``InvalidParameter``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidParameter(f"{what} must be a JSON object, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    """The JSON type name of a parsed value, for error messages (never the value itself: it may be huge)."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), "null")


def _is_int(value: Any) -> bool:
    return type(value) is int  # bool is a subclass of int; JSON's true is not a count


def _shape(tensor: dict, name: str) -> list[int]:
    shape = tensor.get("shape")
    if (not isinstance(shape, list) or not 1 <= len(shape) <= MAX_RANK
            or not all(_is_int(d) and 0 <= d <= MAX_DIMENSION for d in shape)):
        raise InvalidParameter(f"input {name!r}: 'shape' must be a list of 1 to {MAX_RANK} integers "
                               f"in 0..{MAX_DIMENSION}")
    return shape


def _leaves(data: Any, rank: int, expected: int, name: str) -> list:
    """Row-major leaves of a JSON tensor's ``data``: a flat list, or lists nested at most ``rank`` deep.

    No recursion (any depth is refused, not followed) and no level may hold more than
    ``expected`` entries; ``InvalidParameter`` for ragged nesting, too deep or the wrong count.
    """
    if not isinstance(data, list):
        raise InvalidParameter(f"input {name!r}: 'data' must be a list, got {_kind(data)}")
    level = data
    for _ in range(rank - 1):  # data nested as its shape is ``rank`` lists deep
        nested = [isinstance(item, list) for item in level]
        if not any(nested):
            break
        if not all(nested):
            raise InvalidParameter(f"input {name!r}: 'data' mixes lists and values at the same depth")
        if sum(map(len, level)) > expected:
            break
        level = list(itertools.chain.from_iterable(level))
    if any(isinstance(item, list) for item in level):
        raise InvalidParameter(f"input {name!r}: 'data' is nested deeper than its shape or holds too many values")
    if len(level) != expected:
        raise InvalidParameter(f"input {name!r} declares {expected} elements but 'data' holds {len(level)}")
    return level


def _image_elements(tensor: dict, blob: memoryview | None, limits: Limits) -> list[bytes]:
    """The encoded images of an ``IMAGE`` tensor (binary or base64 JSON elements)."""
    if tensor.get("datatype") != "BYTES":
        raise InvalidParameter(f"input {IMAGE!r} must be BYTES, got {_kind_or_text(tensor.get('datatype'))}")
    shape = _shape(tensor, IMAGE)
    if len(shape) > 2 or (len(shape) == 2 and shape[1] != 1):
        raise InvalidParameter(f"input {IMAGE!r} must have shape [N] or [N, 1], got {shape}")
    count = shape[0]
    _check_image_count(count, limits)
    if blob is not None:
        elements = deserialize_bytes(blob, max_elements=count)
    else:
        elements = []
        b64_limit = 4 * -(-limits.max_image_bytes // 3)  # the base64 length of max_image_bytes
        for index, item in enumerate(_leaves(tensor.get("data"), len(shape), count, IMAGE)):
            if not isinstance(item, str):
                raise InvalidParameter(f"{IMAGE}[{index}]: in JSON each image must be a base64 string")
            if len(item) > b64_limit:
                raise PayloadTooLarge(f"{IMAGE}[{index}]: the image is over the limit of {limits.max_image_bytes} bytes")
            try:
                elements.append(base64.b64decode(item, validate=True))
            except (binascii.Error, ValueError):
                raise InvalidParameter(f"{IMAGE}[{index}]: not valid base64 (RFC 4648)") from None
    if len(elements) != count:
        raise InvalidParameter(f"input {IMAGE!r} has shape {shape} but carries {len(elements)} elements")
    for index, data in enumerate(elements):
        if len(data) > limits.max_image_bytes:
            raise PayloadTooLarge(f"{IMAGE}[{index}]: the image is {len(data)} bytes; "
                                  f"the limit is {limits.max_image_bytes}")
    return elements


def _kind_or_text(value: Any) -> str:
    return repr(value[:32]) if isinstance(value, str) else _kind(value)


def _check_image_count(count: int, limits: Limits) -> None:
    if count > limits.max_images:
        raise InvalidParameter(f"{count} images sent; the limit is {limits.max_images}")


def _pixel_images(tensor: dict, blob: memoryview | None, limits: Limits) -> list[bytes]:
    """The images of a ``PIXELS`` tensor, each wrapped as BMP."""
    if tensor.get("datatype") != "UINT8":
        raise InvalidParameter(f"input {PIXELS!r} must be UINT8, got {_kind_or_text(tensor.get('datatype'))}")
    shape = _shape(tensor, PIXELS)
    if len(shape) != 4 or shape[3] != 3 or 0 in shape[1:3]:
        raise InvalidParameter(f"input {PIXELS!r} must have shape [N, H, W, 3] with H, W >= 1, got {shape}")
    _check_image_count(shape[0], limits)
    if shape[1] * shape[2] > limits.max_pixels:
        raise ImageTooLarge(f"input {PIXELS!r}: {shape[2]}x{shape[1]} = {shape[1] * shape[2]} pixels per image; "
                            f"the limit is {limits.max_pixels}")
    as_bmp = bmp_bytes(shape[2], shape[1])
    if as_bmp > limits.max_image_bytes:  # each image is decoded as any upload, from a BMP
        raise PayloadTooLarge(f"input {PIXELS!r}: a {shape[2]}x{shape[1]} image is {as_bmp} "
                              f"bytes as the BMP it is decoded from; the limit per image is {limits.max_image_bytes} "
                              f"bytes (about {limits.max_image_bytes / 3e6:.1f} MP of pixels): send a larger image "
                              f"encoded, as {IMAGE!r}")
    count = math.prod(shape)
    if blob is not None:
        if len(blob) != count:
            raise InvalidParameter(f"input {PIXELS!r} of shape {shape} needs {count} bytes, got {len(blob)}")
        pixels = np.frombuffer(blob, dtype=np.uint8)
    else:
        if count > limits.max_json_values:
            raise PayloadTooLarge(f"input {PIXELS!r} of shape {shape} holds {count} values; JSON data may hold "
                                  f"{limits.max_json_values}: send larger tensors in the binary tensor data extension")
        values = _leaves(tensor.get("data"), len(shape), count, PIXELS)
        if not all(type(v) is int for v in values):
            raise InvalidParameter(f"input {PIXELS!r}: 'data' must be integers in 0..255")
        try:
            pixels = np.array(values, dtype=np.int64)
        except OverflowError:  # an integer beyond int64
            raise InvalidParameter(f"input {PIXELS!r}: 'data' must be integers in 0..255") from None
        if pixels.size and (pixels.min() < 0 or pixels.max() > 255):
            raise InvalidParameter(f"input {PIXELS!r}: 'data' must be integers in 0..255")
        pixels = pixels.astype(np.uint8)
    return _pixels_as_bmp(pixels.reshape(shape))


def _header_split(body: bytes | bytearray, header_length: str | None,
                  max_json_bytes: int) -> tuple[bytes | bytearray, memoryview]:
    """(JSON part, binary part) of a body, ``header_length`` being ``Inference-Header-Content-Length``;
    ``PayloadTooLarge`` for a JSON part over ``max_json_bytes``, before it is sliced out."""
    if header_length is None:
        return body, memoryview(b"")
    split = http.ascii_decimal(header_length)
    if split is None or split > len(body):
        raise InvalidParameter(f"{HEADER_LENGTH} must be a byte count within the body, got {header_length[:32]!r}")
    if split > max_json_bytes:  # before the JSON part is sliced (copied) out of the body
        raise PayloadTooLarge(f"the JSON part of the request is over {max_json_bytes} bytes: send images in "
                              "the binary tensor data extension")
    return body[:split], memoryview(body)[split:]


def parse_infer_request(body: bytes | bytearray, header_length: str | None, limits: Limits) -> InferRequest:
    """Parse an ``/infer`` body: JSON, or JSON of ``header_length`` bytes followed by binary tensor data.

    Total: any body and header value gives an ``InferRequest`` or one of these (never
    another exception): ``InvalidParameter`` (422) for anything that is not a well-formed
    request with exactly one of ``IMAGE`` / ``PIXELS`` (including NaN/Infinity and
    numbers out of any field's range), or more images than ``limits.max_images``;
    ``EmptyBody`` (400) for zero images; ``PayloadTooLarge`` (413) for an image over
    ``limits.max_image_bytes``, a JSON part of more than ``limits.max_json_bytes`` bytes or of more
    than ``limits.max_json_values`` values (checked by counting commas, before the JSON is parsed);
    ``ImageTooLarge`` (413) for
    ``PIXELS`` images over ``limits.max_pixels``. Counts and declared sizes are checked
    before any tensor is split or converted.
    """
    header_bytes, binary = _header_split(body, header_length, limits.max_json_bytes)
    if len(header_bytes) > limits.max_json_bytes:
        raise PayloadTooLarge(f"the JSON part of the request is over {limits.max_json_bytes} bytes: send images in "
                              "the binary tensor data extension")
    if _json_values_bound(header_bytes) > limits.max_json_values:
        raise PayloadTooLarge(f"the JSON part of the request holds over {limits.max_json_values} values: send tensors "
                              "this large in the binary tensor data extension")
    try:
        header = json.loads(header_bytes, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # RecursionError: hostile nesting
        raise InvalidParameter(f"the inference request is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list):
        raise InvalidParameter("the inference request must be a JSON object with an 'inputs' list")
    parameters = _object(header.get("parameters"), "'parameters'")
    if len(header["inputs"]) > 1:
        raise InvalidParameter(f"send exactly one of {IMAGE!r} and {PIXELS!r}, got {len(header['inputs'])} inputs")

    images: list[bytes] | None = None
    offset = 0
    for tensor in header["inputs"]:
        if not isinstance(tensor, dict):
            raise InvalidParameter("each input must be a JSON object")
        name = tensor.get("name")
        if name not in (IMAGE, PIXELS):
            raise InvalidParameter(f"unknown input {_kind_or_text(name)}; the model takes {IMAGE!r} (BYTES) "
                                   f"or {PIXELS!r} (UINT8)")
        blob = None
        size = _object(tensor.get("parameters"), f"input {name!r}: 'parameters'").get("binary_data_size")
        if size is not None:
            if not _is_int(size) or not 0 <= size <= len(binary) - offset:
                raise InvalidParameter(f"input {name!r}: binary_data_size must be a byte count within the body")
            blob = binary[offset:offset + size]  # a view: nothing is copied before the counts are checked
            offset += size
        images = _image_elements(tensor, blob, limits) if name == IMAGE else _pixel_images(tensor, blob, limits)
    if images is None:
        raise InvalidParameter(f"the request has no input; send {IMAGE!r} (BYTES) or {PIXELS!r} (UINT8)")
    if offset != len(binary):
        raise InvalidParameter(f"{len(binary) - offset} bytes of binary data are not claimed by any input")
    if not images:
        raise EmptyBody(f"the {header['inputs'][0].get('name')!r} tensor has no elements")

    outputs = None
    if header.get("outputs") is not None:
        if not isinstance(header["outputs"], list):
            raise InvalidParameter("'outputs' must be a list")
        outputs = []
        for output in header["outputs"]:
            name = output.get("name") if isinstance(output, dict) else None
            if not isinstance(name, str) or name not in OUTPUT_DATATYPES:
                raise InvalidParameter(f"unknown output {_kind_or_text(name)}; the model has {list(OUTPUT_DATATYPES)}")
            params = _object(output.get("parameters"), f"output {name!r}: 'parameters'")
            if params.get("classification") is not None:
                raise InvalidParameter("the classification extension is not supported; read LABELS/SCORES")
            binary_data = params.get("binary_data")
            if binary_data is not None and not isinstance(binary_data, bool):
                raise InvalidParameter(f"output {name!r}: 'binary_data' must be true or false")
            outputs.append((name, binary_data))
    binary_output = parameters.get("binary_data_output", False)
    if not isinstance(binary_output, bool):
        raise InvalidParameter("'binary_data_output' must be true or false")
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidParameter(f"'id' must be a string, got {_kind(request_id)}")
    return InferRequest(None if request_id is None else request_id[:MAX_ID_CHARS], images, parameters, outputs,
                        binary_output)


class _Parameters:
    """Request parameters seen through the interface ``rampart.api.http``'s parsers read (headers, query).

    So ``top_k``, ``deadline_ms`` and ``priority`` get exactly the checks (and defaults)
    of ``?top_k``, ``X-Deadline-Ms`` and ``X-Priority`` on ``/classify``.
    """

    def __init__(self, request: Request, parameters: dict) -> None:
        headers = MutableHeaders(raw=list(request.headers.raw))  # a parameter replaces every copy of its header
        if "deadline_ms" in parameters:
            headers["x-deadline-ms"] = _text(parameters["deadline_ms"], "deadline_ms")
        elif "timeout" in parameters:  # Triton's per-request timeout, in microseconds
            headers["x-deadline-ms"] = str(_number(parameters["timeout"], "timeout") / 1000.0)
        if "priority" in parameters:
            headers["x-priority"] = _priority(parameters["priority"])
        self.headers = headers
        self.scope = request.scope  # the arrival time (``rampart.api.arrival``) lives there
        self.sets_deadline = "deadline_ms" in parameters or "timeout" in parameters
        self.query_params = request.query_params
        if "top_k" in parameters:  # the parameter replaces every copy of the query's
            self.query_params = QueryParams([(key, value) for key, value in request.query_params.multi_items()
                                             if key != "top_k"] + [("top_k", _text(parameters["top_k"], "top_k"))])


def request_options(request: Request, parameters: dict, settings: Settings, lag_ms: float,
                    deadline: Deadline) -> tuple[int, str, Deadline]:
    """``(top_k, priority, deadline)`` of an inference request: its ``parameters`` over the request's query and
    headers (``X-Deadline-Ms``, ``X-Priority``), each read by the parser ``/classify`` uses.

    ``deadline`` is the one the headers gave; a ``deadline_ms`` or ``timeout`` parameter replaces it,
    counted from the same arrival, and so does a ``priority`` parameter where no deadline was sent: the
    class's own default then applies (``low_priority_deadline_ms`` for low, as for ``X-Priority: low``).
    ``InvalidParameter`` (422) for any value out of its range or type.
    """
    view = _Parameters(request, parameters)
    top_k = http.parse_top_k(view)
    with _named_as_parameter("X-Priority", "priority" if "priority" in parameters else None):
        priority = http.parse_priority(view)
    if view.sets_deadline:  # counted from the same arrival as the header's
        with _named_as_parameter("X-Deadline-Ms", "deadline_ms" if "deadline_ms" in parameters else
                                 "timeout (µs; the value shown is in ms)"):
            deadline = http.parse_deadline(view, settings, lag_ms, deadline.arrival)
    elif "priority" in parameters:  # the class's default deadline, unless X-Deadline-Ms gave one (kept as is)
        deadline = http.parse_deadline(view, settings, lag_ms, deadline.arrival)
    return top_k, priority, deadline


@contextlib.contextmanager
def _named_as_parameter(header: str, parameter: str | None):
    """Errors of a value that came from the request's ``parameter`` (not its ``header``) name the parameter: a
    ``deadline_ms`` of -1 said "X-Deadline-Ms must be positive". ``parameter`` None: the header gave it."""
    try:
        yield
    except (InvalidParameter, DeadlineTooShort) as error:
        if parameter is None or header not in error.message:
            raise
        raise type(error)(error.message.replace(header, f"parameter {parameter}")) from None


def _text(value: Any, name: str) -> str:
    """``value`` (a number, or a string the header's parser then reads) as a header's text; ``InvalidParameter``
    for anything else, and for a string no number could be written in: one that is not ASCII would not even
    encode as a header (a ``deadline_ms`` of "\u0100" was a ``UnicodeEncodeError``, a 500)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidParameter(f"parameter {name} must be a number, got {_kind(value)}")
    if isinstance(value, str) and not value.isascii():
        raise InvalidParameter(f"parameter {name} must be a number, got {value[:32]!r}")
    return str(value)


def _number(value: Any, name: str) -> float:
    try:
        return float(_text(value, name))
    except ValueError:
        raise InvalidParameter(f"parameter {name} must be a number, got {str(value)[:32]!r}") from None


def _priority(value: Any) -> str:
    """Triton's integer levels (1 high; 0 default and 2 normal; 3 low) or Rampart's words."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value in (0, 1, 2, 3):
            return {1: "high", 3: "low"}.get(value, "normal")
        raise InvalidParameter(f"parameter priority must be 0, 1 (high), 2 (normal) or 3 (low), got {str(value)[:32]}")
    if isinstance(value, str) and value.isascii():  # read by the header's parser; not ASCII: no header, no class
        return value
    shown = repr(value[:32]) if isinstance(value, str) else _kind(value)
    raise InvalidParameter(f"parameter priority must be 'high', 'normal', 'low' or 0..3, got {shown}")


def _rows(results: list[dict], top_k: int) -> dict[str, np.ndarray]:
    """The output tensors of N answers: [N, top_k] arrays, padded for answers without labels, and the
    [N, 1] per-image outcomes."""
    labels = np.full((len(results), top_k), b"", dtype=object)
    scores = np.zeros((len(results), top_k), dtype=np.float32)
    indices = np.full((len(results), top_k), -1, dtype=np.int64)
    for row, result in enumerate(results):
        for column, entry in enumerate(result["labels"][:top_k]):
            labels[row, column] = entry["label"].encode("utf-8")
            scores[row, column] = entry["score"]
            indices[row, column] = entry["index"]

    def column(values: list) -> np.ndarray:
        return np.array(values, dtype=object).reshape(len(results), 1)

    return {LABELS: labels, SCORES: scores, CLASS_INDICES: indices,
            DEGRADED_REASON: column([(r["degraded_reason"] or "").encode() for r in results]),
            MODEL: column([(r["model"] or {}).get("name", "").encode() for r in results]),
            ROUTE: column([(r.get("route") or "").encode() for r in results]),
            NEEDS_REVIEW: np.array([bool(r["needs_review"]) for r in results], dtype=bool).reshape(len(results), 1)}


def _response_parameters(results: list[dict], request_id: str) -> dict:
    timings = [result["timings_ms"] for result in results]
    return {
        "request_id": request_id,
        "degraded": any(result["degraded"] for result in results),
        "needs_review": any(result["needs_review"] for result in results),
        **{f"{stage}_ms": max(t[stage] for t in timings) for stage in ("decode", "queue", "inference", "total")},
    }


def encode_infer_response(parsed: InferRequest, results: list[dict], top_k: int, request_id: str,
                          model_version: str) -> Response:
    """The ``/infer`` answer for ``results`` (``Pipeline.classify`` bodies, one per image).

    Outputs are binary (with ``Inference-Header-Content-Length``) where the request asked
    for it, per output (``binary_data``) or for all (``binary_data_output``); JSON otherwise.
    """
    tensors = _rows(results, top_k)
    wanted = parsed.outputs if parsed.outputs is not None else [(name, None) for name in OUTPUT_DATATYPES]
    outputs, blobs = [], []
    for name, binary in wanted:
        array = tensors[name]
        entry = {"name": name, "datatype": OUTPUT_DATATYPES[name], "shape": list(array.shape)}
        text = OUTPUT_DATATYPES[name] == "BYTES"
        if binary if binary is not None else parsed.binary_output:
            blob = serialize_bytes(list(array.ravel())) if text else array.astype(array.dtype.newbyteorder("<")).tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = [b.decode("utf-8") for b in array.ravel()] if text else array.ravel().tolist()
        outputs.append(entry)
    body = {"model_name": MODEL_NAME, "model_version": model_version,
            "parameters": _response_parameters(results, request_id), "outputs": outputs}
    if parsed.id is not None:
        body["id"] = parsed.id
    headers = {"X-Request-Id": request_id}
    if not blobs:
        return JsonResponse(body, headers=headers)
    header = json.dumps(body, separators=(",", ":")).encode("utf-8")
    headers[HEADER_LENGTH] = str(len(header))
    return Response(header + b"".join(blobs), media_type="application/octet-stream", headers=headers)


def error_response(error: RampartError, request_id: str) -> JsonResponse:
    """The protocol's error body ``{"error": "<code>: <message>"}`` with Rampart's status (and ``Retry-After``
    on 429 and 503, ``Allow`` on 405)."""
    headers = {"X-Request-Id": request_id}
    retry_after_s = getattr(error, "retry_after_s", None)  # Overloaded, Unavailable
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(retry_after_s)))
    if isinstance(error, MethodNotAllowed) and error.allowed:
        headers["Allow"] = ", ".join(error.allowed)
    return JsonResponse({"error": f"{error.code}: {error.message}"}, status_code=error.status, headers=headers)


def model_metadata(version: str) -> dict:
    """``GET /v2/models/rampart``: name, versions, platform and tensors (-1: variable size).

    Each shape is the configuration's ``dims`` (``model_config``) after a variable batch
    dimension, as Triton reports a model with ``max_batch_size`` > 0.
    """
    return {
        "name": MODEL_NAME,
        "versions": [version],
        "platform": "rampart",
        "inputs": [
            {"name": IMAGE, "datatype": "BYTES", "shape": [-1, 1]},
            {"name": PIXELS, "datatype": "UINT8", "shape": [-1, -1, -1, 3]},
        ],
        "outputs": [{"name": name, "datatype": datatype, "shape": [-1, -1 if name in TOP_K_OUTPUTS else 1]}
                    for name, datatype in OUTPUT_DATATYPES.items()],
    }


def _config_type(datatype: str) -> str:
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def model_config(settings: Settings, version: str, models: dict[str, str] | None = None) -> dict:
    """``GET /v2/models/rampart/config``: a Triton model configuration (JSON form) for ``perf_analyzer``.

    ``max_batch_size`` is ``max_batch_images`` (images per request); ``dynamic_batching``
    describes the primary's batcher (``primary_max_batch_size``, ``primary_queue_delay_ms``),
    three priority levels (1 high, 2 normal, 3 low) and the default deadline as queue timeout.
    ``dims`` leave out the batch dimension: ``IMAGE`` is ``[1]`` (one encoded image per
    batch element, the request's shape ``[N, 1]``), ``PIXELS`` ``[-1, -1, 3]``; both are
    optional, since a request sends one of them. ``models`` (role: ``name:version``, the
    BentoML models behind the pipeline) become ``parameters`` ``primary_model`` etc.
    """
    return {
        "name": MODEL_NAME,
        "platform": "rampart",
        "backend": "rampart",
        "version_policy": {"specific": {"versions": [version]}},
        "max_batch_size": settings.inputs.max_batch_images,
        "input": [
            {"name": IMAGE, "data_type": "TYPE_STRING", "format": "FORMAT_NONE", "dims": [1], "optional": True},
            {"name": PIXELS, "data_type": "TYPE_UINT8", "format": "FORMAT_NHWC", "dims": [-1, -1, 3],
             "optional": True},
        ],
        "output": [{"name": name, "data_type": _config_type(datatype), "dims": [-1 if name in TOP_K_OUTPUTS else 1]}
                   for name, datatype in OUTPUT_DATATYPES.items()],
        "dynamic_batching": {
            "preferred_batch_size": [settings.primary.max_batch_size],
            "max_queue_delay_microseconds": int(settings.primary.queue_delay_ms * 1000),
            "priority_levels": 3,
            "default_priority_level": 2,
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": int(settings.deadlines.default_deadline_ms * 1000),
                "allow_timeout_override": True,
            },
        },
        "parameters": {
            "max_deadline_ms": {"string_value": str(settings.deadlines.max_deadline_ms)},
            "max_body_bytes": {"string_value": str(settings.inputs.max_body_bytes)},
            **{f"{role}_model": {"string_value": tag} for role, tag in (models or {}).items()},
        },
    }


def repository_index(version: str, ready: bool, ready_only: bool = False) -> list[dict]:
    """``POST /v2/repository/index``: the one model, ``READY`` or ``UNAVAILABLE`` (left out when
    ``ready_only`` and not ready)."""
    if ready_only and not ready:
        return []
    entry = {"name": MODEL_NAME, "version": version, "state": "READY" if ready else "UNAVAILABLE"}
    if not ready:
        entry["reason"] = "warming up or draining"
    return [entry]


@dataclass
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, ms: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(ms * 1_000_000)


@dataclass
class InferenceStatistics:
    """Counts of one API worker's ``/v2`` inference requests, in the statistics extension's form.

    Counted per request, as Triton counts a batch request: ``success``/``fail``: requests
    answered 200 / with an error, and their time from the handler's start to the answer;
    for each request answered, ``queue``, ``compute_input`` (decode) and ``compute_infer``
    are the slowest image's ``queue``, ``decode`` and ``inference`` timings and
    ``compute_output`` the time to encode the answer; ``inference_count``: images answered;
    ``execution_count``: requests answered; ``last_inference``: ms since the epoch.
    """

    success: _Duration = field(default_factory=_Duration)
    fail: _Duration = field(default_factory=_Duration)
    queue: _Duration = field(default_factory=_Duration)
    compute_input: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    compute_output: _Duration = field(default_factory=_Duration)
    inference_count: int = 0
    execution_count: int = 0
    last_inference: int = 0

    def answered(self, results: list[dict], elapsed_ms: float, encode_ms: float) -> None:
        """Count a request answered 200 with ``results`` (``Pipeline.classify`` bodies) after ``elapsed_ms``,
        its answer encoded in ``encode_ms``."""
        self.success.add(elapsed_ms)
        for stage, duration in (("queue", self.queue), ("decode", self.compute_input),
                                ("inference", self.compute_infer)):
            duration.add(max(result["timings_ms"][stage] for result in results))
        self.compute_output.add(encode_ms)
        self.inference_count += len(results)
        self.execution_count += 1
        self.last_inference = int(time.time() * 1000)

    def failed(self, elapsed_ms: float) -> None:
        """Count a request answered with an error after ``elapsed_ms``."""
        self.fail.add(elapsed_ms)

    def body(self, version: str) -> dict:
        """The ``model_stats`` entry of the served model."""
        stages = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
        return {"name": MODEL_NAME, "version": version, "last_inference": self.last_inference,
                "inference_count": self.inference_count, "execution_count": self.execution_count,
                "inference_stats": {stage: vars(getattr(self, stage)).copy() for stage in stages},
                "batch_stats": []}


def _decompressor(encoding: str | None) -> Any:
    """A zlib decompressor for a ``Content-Encoding`` value, or None for an uncompressed body.

    ``UnsupportedFormat`` (415) for any other encoding, or a list of several.
    """
    name = (encoding or "identity").strip().lower()
    if name not in ENCODINGS:
        raise UnsupportedFormat(f"Content-Encoding {encoding[:32]!r} is not supported on /v2; "
                                f"send the body as identity, gzip or deflate")
    wbits = ENCODINGS[name]
    return None if wbits is None else zlib.decompressobj(wbits)


async def _inflated(chunks: AsyncIterator[bytes], decompressor: Any, limit: int,
                    hold: Callable[[int], bool] = lambda size: True, gzip_members: bool = False) -> bytearray:
    """The decompressed body of compressed ``chunks``: ``PayloadTooLarge`` as soon as it passes ``limit``
    bytes (a bomb stops there), ``InvalidParameter`` for data that is not valid or ends early.

    With ``gzip_members`` (a gzip body) a member may follow the last, up to ``MAX_GZIP_MEMBERS`` in all
    (RFC 1952, section 2.2: a gzip file is a series of members; what ``gzip.decompress`` reads); any other
    data after the end is refused.

    Inflated ``INFLATE_SLICE_BYTES`` at a time in a worker thread, so the event loop runs on while zlib
    works; each slice is counted with ``hold(size)`` first (the worker's budget of body bytes,
    ``rampart.api.arrival.hold_body_bytes``), and ``hold`` returning False raises ``BodiesOverBudget``.
    Returned as the ``bytearray`` it was inflated into (no copy).
    """
    body, members, carried = bytearray(), 1, b""
    try:
        async for chunk in chunks:
            data, carried = carried + chunk if carried else chunk, b""
            while True:
                if decompressor.eof:  # what follows the end of a stream: nothing, or (gzip) the next member
                    if not data:
                        break
                    if gzip_members and len(data) < len(_GZIP_MAGIC) and _GZIP_MAGIC.startswith(data):
                        carried = data  # the next member's magic is cut between two chunks
                        break
                    if not (gzip_members and data[:2] == _GZIP_MAGIC):
                        raise InvalidParameter("the compressed body has data after its end")
                    if members == MAX_GZIP_MEMBERS:
                        raise InvalidParameter(f"the gzip body has more than {MAX_GZIP_MEMBERS} members")
                    decompressor, members = zlib.decompressobj(16 + zlib.MAX_WBITS), members + 1
                piece = await asyncio.to_thread(decompressor.decompress, data, INFLATE_SLICE_BYTES)
                if len(body) + len(piece) > limit:
                    raise PayloadTooLarge(f"the decompressed body is over the limit of {limit} bytes")
                if not hold(len(piece)):
                    raise BodiesOverBudget
                body += piece
                if decompressor.eof:
                    data = decompressor.unused_data
                else:
                    data = decompressor.unconsumed_tail
                    if not data and len(piece) < INFLATE_SLICE_BYTES:
                        break
    except zlib.error as exc:
        raise InvalidParameter(f"the body is not valid per its Content-Encoding: {exc}") from None
    if carried:
        raise InvalidParameter("the compressed body has data after its end")
    if not decompressor.eof:
        raise InvalidParameter("the compressed body ends before its end of stream")
    return body


class BodiesOverBudget(Exception):
    """An inflated body's next slice does not fit in the worker's budget of body bytes (``MAX_HELD_BODY_BYTES``)."""


async def read_infer_body(request: Request, limit: int, deadline: Deadline, settings: Settings,
                          retry_after_s: Callable[[], float]) -> bytes | bytearray:
    """The body of an ``/infer`` request, decompressed per ``Content-Encoding`` (gzip, deflate or none),
    read within ``deadline``.

    Both the compressed and the decompressed body are held to ``limit`` bytes, and to ``MAX_JSON_BYTES``
    when the request has no binary tensor data (no ``Inference-Header-Content-Length``): all of it is
    JSON (``PayloadTooLarge``). The inflated bytes count against the worker's budget of body bytes
    (``rampart.api.arrival.hold_body_bytes``): 429 ``overloaded`` with ``retry_after_s()`` when they do
    not fit. ``UnsupportedFormat`` (415) for another encoding; else the errors of
    ``rampart.api.http.read_body``.
    """
    decompressor = _decompressor(request.headers.get("content-encoding"))
    if http.single_header(request, HEADER_LENGTH.lower()) is None:
        limit = min(limit, MAX_JSON_BYTES)
    if decompressor is None:
        return await http.read_body_once(request, limit, deadline)
    try:
        gzip_members = (request.headers.get("content-encoding") or "").strip().lower() in ("gzip", "x-gzip")
        return await http.within_deadline(_inflated(http.body_chunks(request, limit), decompressor, limit,
                                                    functools.partial(hold_body_bytes, request.scope), gzip_members),
                                          deadline,
                                          "the body was not received and decompressed")
    except BodiesOverBudget:
        raise http.bodies_over_budget(settings, retry_after_s()) from None


#: A JSON part larger than this is parsed in a decode worker process (``parse_in_worker``), not in a thread of the
#: API worker: ``json.loads`` holds the GIL for the whole parse, and within ``MAX_JSON_BYTES`` and
#: ``MAX_JSON_VALUES`` its cost depends on what the JSON holds. Measured on the 2-core host (2026-12-08), in ms per
#: MiB: 2-3 for whitespace or a long string (escaped or not), 7 for short strings, 13 for small integers, 21 for
#: 4000-digit integers, 35 for long floats, 75 for object keys, 95 for empty lists: a 24 MB body of a million
#: floats (58 KB gzipped) stalled the event loop for 0.75-0.85 s, and two clients sending it left no request a
#: full answer. Under this size a parse costs at most about 25 ms.
PARSE_IN_WORKER_BYTES = 256 << 10
#: The request parameters that Rampart reads (``request_options``; ``binary_data_output`` is read in the parse).
PARAMETERS_READ = ("deadline_ms", "timeout", "priority", "top_k")
#: A string parameter sent back from a decode worker is cut to this many characters: no number or priority is
#: longer, and the checks show at most 32 of them.
MAX_PARAMETER_CHARS = 4096


def parse_in_worker(body: bytes | bytearray, header_length: str | None, limits: Limits) -> InferRequest:
    """``parse_infer_request`` for a decode worker process (``rampart.inputs.pool``): the same request and errors,
    its ``parameters`` cut down to ``PARAMETERS_READ``, each value that is not a number, boolean, null or string
    replaced by an empty one of its JSON type and each string cut to ``MAX_PARAMETER_CHARS``, so that what comes
    back to the API worker is small whatever the body held, and ``request_options`` gives the same answer."""
    parsed = parse_infer_request(body, header_length, limits)
    parsed.parameters = {name: _bounded(value) for name, value in parsed.parameters.items() if name in PARAMETERS_READ}
    return parsed


def _bounded(value: Any) -> Any:
    if isinstance(value, str):
        return value[:MAX_PARAMETER_CHARS]
    return value if value is None or isinstance(value, (bool, int, float)) else type(value)()


def _json_part_bytes(body: bytes | bytearray, header_length: str | None) -> int:
    """Bytes of the JSON part: ``header_length`` when it is a count (read as ``_header_split`` reads it), else the
    whole body (``_header_split`` then refuses the header)."""
    split = None if header_length is None else http.ascii_decimal(header_length)
    return len(body) if split is None else min(split, len(body))


async def _parse_within(body: bytes | bytearray, header_length: str | None, limits: Limits, deadline: Deadline,
                        pool: BoundedPool | None = None, run_limit_s: float | None = None) -> InferRequest:
    """``parse_infer_request`` in a worker thread, or, for a JSON part over ``PARSE_IN_WORKER_BYTES`` and a ``pool``
    of processes, in a decode worker (``parse_in_worker``, killed past ``run_limit_s``); ``RequestTimeout`` (408) if
    it is not done by the deadline, or in the worker within ``run_limit_s``; ``Overloaded`` (429) when no decode
    worker is free in time; ``InvalidParameter`` (422) when the worker died on the body."""
    if pool is not None and pool.processes and _json_part_bytes(body, header_length) > PARSE_IN_WORKER_BYTES:
        try:
            return await pool.run(parse_in_worker, body, header_length, limits, budget_s=deadline.remaining_s(),
                                  run_limit_s=run_limit_s)
        except JobTimeout:
            raise RequestTimeout(f"the request could not be parsed within the deadline ({deadline.share_ms():.0f} ms) "
                                 "or the decode time limit") from None
        except WorkerDied as exc:
            raise InvalidParameter(f"the inference request could not be parsed: {exc}") from None
    try:
        return await run_within(asyncio.to_thread(parse_infer_request, body, header_length, limits),
                                deadline.remaining_s())
    except asyncio.TimeoutError:
        raise RequestTimeout(f"the request could not be parsed within the deadline ({deadline.share_ms():.0f} ms)") from None


def routes(settings: Settings, backend: Backend, account: Callable[..., None]) -> list[Route]:
    """The protocol's Starlette routes.

    ``backend`` is the app's state (pipeline, lifecycle, loop lag, readiness:
    ``rampart.api.app.AppState``); ``account(request, request_id, priority, started, status,
    code, **extra)`` counts and logs each inference answer (``rampart.api.app.finished``),
    so ``/v2`` traffic shows in the same metrics and access log.
    """
    limits = Limits.of(settings)
    statistics = InferenceStatistics()

    def unknown_model(request: Request) -> JsonResponse | None:
        name = request.path_params["name"]
        wanted = request.path_params.get("version")
        if name != MODEL_NAME or (wanted is not None and wanted != MODEL_VERSION):
            asked = name if wanted is None else f"{name} version {wanted}"
            return JsonResponse({"error": f"unknown model {asked[:200]!r}; this server serves {MODEL_NAME!r} "
                                          f"version {MODEL_VERSION!r}"}, status_code=404)
        return None

    async def server_metadata(request: Request) -> JsonResponse:
        return JsonResponse({"name": MODEL_NAME, "version": SERVER_VERSION, "extensions": EXTENSIONS})

    async def live(request: Request) -> JsonResponse:
        return JsonResponse({"live": True})

    async def ready(request: Request) -> JsonResponse:
        is_ready = backend.ready()
        return JsonResponse({"ready": is_ready}, status_code=200 if is_ready else 503)

    async def model_ready(request: Request) -> JsonResponse:
        missing = unknown_model(request)
        if missing is not None:
            return missing
        is_ready = backend.ready()
        return JsonResponse({"name": MODEL_NAME, "ready": is_ready}, status_code=200 if is_ready else 503)

    async def metadata(request: Request) -> JsonResponse:
        return unknown_model(request) or JsonResponse(model_metadata(MODEL_VERSION))

    async def config(request: Request) -> JsonResponse:
        if (missing := unknown_model(request)) is not None:
            return missing
        pipeline = backend.pipeline
        models = {role: f"{lane.endpoint.name}:{lane.endpoint.version}"
                  for role, lane in (("primary", pipeline.primary), ("fallback", pipeline.fallback))}
        return JsonResponse(model_config(settings, MODEL_VERSION, models))

    async def index(request: Request) -> JsonResponse:
        request_id = http.request_id_of(request)
        try:
            deadline = http.parse_deadline(request, settings)
            raw = await http.read_body(request, MAX_INDEX_BODY_BYTES, deadline)
            try:
                body = json.loads(raw, parse_constant=_refuse_constant) if raw.strip() else {}
            except (ValueError, RecursionError):
                raise InvalidParameter("the repository index request must be empty or a JSON object") from None
            ready_only = _object(body, "the repository index request").get("ready", False)
            if not isinstance(ready_only, bool):
                raise InvalidParameter("'ready' must be true or false")
        except RampartError as exc:
            return error_response(exc, request_id)
        return JsonResponse(repository_index(MODEL_VERSION, backend.ready(), ready_only))

    async def stats(request: Request) -> JsonResponse:
        if "name" in request.path_params:
            missing = unknown_model(request)
            if missing is not None:
                return missing
        return JsonResponse({"model_stats": [statistics.body(MODEL_VERSION)]})

    async def infer(request: Request) -> Response:
        started, request_id = time.perf_counter(), http.request_id_of(request)
        try:  # refused (503) before warm-up and during a drain, else counted in flight until answered
            admission = backend.lifecycle.admit()
        except RampartError as exc:
            account(request, request_id, "normal", started, exc.status, exc.code)
            return error_response(exc, request_id)
        with admission:
            return await admitted_infer(request, started, request_id)

    async def admitted_infer(request: Request, started: float, request_id: str) -> Response:
        priority = "normal"
        missing = unknown_model(request)
        if missing is not None:
            return missing
        try:
            lag_ms = backend.loop_lag_ms()
            deadline = http.parse_deadline(request, settings, lag_ms)
            priority = http.parse_priority(request)
            pipeline = backend.pipeline
            pipeline.check_capacity(deadline, priority)  # sheds (429) before the body is read
            limit = settings.inputs.max_batch_images * (settings.inputs.max_body_bytes + http.MULTIPART_OVERHEAD_BYTES)
            body = await read_infer_body(request, limit, deadline, settings, pipeline.retry_after_s)  # /classify_batch's cap
            parsed = await _parse_within(body, http.single_header(request, HEADER_LENGTH.lower()), limits, deadline,
                                         pipeline.pool, settings.decoding.timeout_ms / 1000)
            del body  # the images hold what is needed of it
            top_k, priority, deadline = request_options(request, parsed.parameters, settings, lag_ms, deadline)
            results = await _classify_all(pipeline, parsed.images, top_k, deadline, priority)
        except Exception as exc:
            if not isinstance(exc, RampartError):
                logger.exception("unexpected failure for request %s", request_id, exc_info=exc)
                exc = InternalError("an unexpected error occurred; see the server log")
            account(request, request_id, priority, started, exc.status, exc.code)
            statistics.failed((time.perf_counter() - started) * 1000.0)
            return error_response(exc, request_id)
        encoding = time.perf_counter()
        response = encode_infer_response(parsed, results, top_k, request_id, MODEL_VERSION)
        answered = time.perf_counter()
        account(request, request_id, priority, started, 200, "ok", images=len(results))
        statistics.answered(results, (answered - started) * 1000.0, (answered - encoding) * 1000.0)
        return response

    paths = ["/v2/models/{name}", "/v2/models/{name}/versions/{version}"]
    return [
        Route("/v2", server_metadata, methods=["GET"]),
        Route("/v2/health/live", live, methods=["GET"]),
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/v2/repository/index", index, methods=["POST"]),
        Route("/v2/models/stats", stats, methods=["GET"]),  # before /v2/models/{name}, which it also matches
        *(Route(f"{path}/ready", model_ready, methods=["GET"]) for path in paths),
        *(Route(path, metadata, methods=["GET"]) for path in paths),
        *(Route(f"{path}/config", config, methods=["GET"]) for path in paths),
        *(Route(f"{path}/stats", stats, methods=["GET"]) for path in paths),
        *(Route(f"{path}/infer", infer, methods=["POST"]) for path in paths),
    ]


async def _classify_all(pipeline: Any, images: list[bytes], top_k: int, deadline: Deadline,
                        priority: str) -> list[dict]:
    """``pipeline.classify`` for every image at once; the first failing image (by index) fails the request."""
    answers = await asyncio.gather(*(pipeline.classify(data, top_k, deadline, priority) for data in images),
                                   return_exceptions=True)
    for index, answer in enumerate(answers):
        if isinstance(answer, RampartError):
            if len(images) > 1:
                answer.message = f"image {index}: {answer.message}"
            raise answer
        if isinstance(answer, BaseException):
            raise answer
    return answers
