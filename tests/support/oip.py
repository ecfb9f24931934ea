"""Open Inference Protocol cases the in-process, server and Triton-peer tests share: request inputs and
response texts read with ``tritonclient``, a pipeline answer, and the hostile request bodies."""

from __future__ import annotations

import base64
import json

import numpy as np
import tritonclient.http as triton

from rampart.api import oip


#: Generous, so a loaded 2-core machine does not turn the comparisons into degraded answers.
DEADLINE_MS = 5000


def image_input(images: list[bytes], binary: bool) -> triton.InferInput:
    """An ``IMAGE`` input: raw bytes in the binary extension, base64 strings in JSON."""
    tensor = triton.InferInput(oip.IMAGE, [len(images)], "BYTES")
    elements = images if binary else [base64.b64encode(image) for image in images]
    tensor.set_data_from_numpy(np.array(elements, dtype=object), binary_data=binary)
    return tensor


def texts(array: np.ndarray) -> list:
    """A BYTES output as nested lists of str (tritonclient gives bytes from binary data, str from JSON)."""
    return [[v.decode() if isinstance(v, bytes) else v for v in row] for row in array.tolist()]


def bad_request(header: dict) -> bytes:
    """A JSON-only request body (no binary part) from ``header``."""
    return json.dumps(header).encode()


def answer(labels: list[tuple[int, str, float]], reason: str | None = None) -> dict:
    """A pipeline answer with ``labels`` as ``(index, label, score)`` (degraded with ``reason`` when given)."""
    return {"labels": [{"index": i, "label": n, "score": s} for i, n, s in labels], "degraded": reason is not None,
            "degraded_reason": reason, "needs_review": not labels,
            "model": {"name": "rampart-primary", "version": "v"} if labels else None,
            "timings_ms": {"decode": 1.0, "queue": 2.0, "inference": 3.0, "total": 6.0}}


def image_json(**changes) -> dict:
    """A one-image JSON request (``IMAGE``, BYTES, base64), its input changed by ``changes``."""
    return {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": ["eA=="], **changes}]}


def pixels_json(**changes) -> dict:
    """A 1×1 ``PIXELS`` (UINT8) JSON request, its input changed by ``changes``."""
    return {"inputs": [{"name": "PIXELS", "datatype": "UINT8", "shape": [1, 1, 1, 3], "data": [1, 2, 3], **changes}]}


def raw(text: str) -> bytes:
    """A request body written by hand (for JSON that ``json.dumps`` cannot write)."""
    return text.encode()


HOSTILE = {
    "shape-1e300": (bad_request(image_json(shape=[1e300])), None),
    "shape-30-digits": (raw('{"inputs":[{"name":"IMAGE","datatype":"BYTES","shape":[123456789012345678901234567890],'
                            '"data":["eA=="]}]}'), None),
    "shape-bool": (bad_request(image_json(shape=[True])), None),
    "shape-infinity": (raw('{"inputs":[{"name":"IMAGE","datatype":"BYTES","shape":[Infinity],"data":["eA=="]}]}'), None),
    "nan-parameter": (raw('{"inputs":[{"name":"IMAGE","datatype":"BYTES","shape":[1],"data":["eA=="]}],'
                          '"parameters":{"deadline_ms":NaN}}'), None),
    "pixel-1e300": (bad_request(pixels_json(data=[1e300, 0, 0])), None),
    "pixel-30-digits": (raw('{"inputs":[{"name":"PIXELS","datatype":"UINT8","shape":[1,1,1,3],'
                            '"data":[123456789012345678901234567890,0,0]}]}'), None),
    "pixel-float": (bad_request(pixels_json(data=[1.5, 0, 0])), None),
    "pixel-bool": (bad_request(pixels_json(data=[True, 0, 0])), None),
    "pixel-negative": (bad_request(pixels_json(data=[-1, 0, 0])), None),
    "pixel-ragged": (bad_request(pixels_json(data=[[1, 2], 3])), None),
    "pixels-over-max-pixels": (bad_request(pixels_json(shape=[1, 60_000, 1_000, 3])), None),
    "parameters-list": (bad_request({**image_json(), "parameters": [1, 2]}), None),
    "parameters-string": (bad_request({**image_json(), "parameters": "top_k=3"}), None),
    "tensor-parameters-list": (bad_request(image_json(parameters=[{"binary_data_size": 1}])), None),
    "tensor-parameters-string": (bad_request(image_json(parameters="binary")), None),
    "output-parameters-list": (bad_request({**image_json(), "outputs": [{"name": "LABELS", "parameters": [1]}]}), None),
    "output-binary-data-string": (bad_request({**image_json(), "outputs": [{"name": "LABELS",
                                                                            "parameters": {"binary_data": "yes"}}]}), None),
    "binary-size-float": (bad_request(image_json(parameters={"binary_data_size": 1e300})), "60"),
    "binary-size-bool": (bad_request(image_json(parameters={"binary_data_size": True})), None),
    "id-object": (bad_request({**image_json(), "id": {"a": 1}}), None),
    "top-k-1e300": (bad_request({**image_json(), "parameters": {"top_k": 1e300}}), None),
    "data-nested-500": (raw('{"inputs":[{"name":"IMAGE","datatype":"BYTES","shape":[1],"data":'
                            + "[" * 500 + '"eA=="' + "]" * 500 + "}]}"), None),
    "data-nested-5000": (raw('{"inputs":[{"name":"IMAGE","datatype":"BYTES","shape":[1],"data":'
                             + "[" * 5000 + "]" * 5000 + "}]}"), None),
    "header-length-arabic-digits": (bad_request(image_json()), "\u0661\u0662"),
    "header-length-superscript": (bad_request(image_json()), "\u00b2"),
    "header-length-negative": (bad_request(image_json()), "-1"),
    "header-length-huge": (bad_request(image_json()), "9" * 40),
    "not-utf8": (b'{"inputs": "\xff\xfe"}', None),
    "two-inputs": (bad_request({"inputs": image_json()["inputs"] * 2}), None),
}
