"""Write perf_analyzer's input-data files for Rampart's ``/v2`` model (``python -m bench.perf_analyzer.make_inputs``).

perf_analyzer reads ``--input-data FILE``: ``{"data": [{TENSOR: ...}, ...]}``, one entry per request
it cycles through. A BYTES tensor can be given as ``{"b64": ...}``: base64 of the tensor's raw
bytes, which for BYTES is Triton's serialized form (each element a 4-byte little-endian
length, then its bytes; ``rampart.api.oip.serialize_bytes``); the shape is the model's
(``IMAGE`` ``[1]`` per batch element, from the configuration's ``dims``). A UINT8 tensor with
variable dimensions is given as ``{"content": [...], "shape": [H, W, 3]}`` (without the batch dimension).

- ``inputs.json``: ``IMAGE``, the bundled photo ``chelsea`` (scikit-image's, 451×300) as a JPEG;
- ``pixels.json``: ``PIXELS``, the same photo resized to 96×64, as raw RGB values.

Both files are committed; this script rebuilds them (the unit tests check they still match it).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from PIL import Image

from rampart.api.oip import IMAGE, PIXELS, serialize_bytes
from tests.support import encode, photo

HERE = Path(__file__).resolve().parent
#: The bundled photo both files carry, and the size (W, H) of its PIXELS copy.
PHOTO, PIXELS_SIZE = "chelsea", (96, 64)


def image_inputs() -> dict:
    """``inputs.json``: one request, ``IMAGE`` = the photo as a JPEG (quality 85)."""
    jpeg = encode(photo(PHOTO), quality=85)
    return {"data": [{IMAGE: {"b64": base64.b64encode(serialize_bytes([jpeg])).decode("ascii")}}]}


def pixel_inputs() -> dict:
    """``pixels.json``: one request, ``PIXELS`` = the photo resized to ``PIXELS_SIZE`` (W × H), H × W × 3 values."""
    image = Image.fromarray(photo(PHOTO)).resize(PIXELS_SIZE)
    width, height = PIXELS_SIZE
    return {"data": [{PIXELS: {"content": list(image.tobytes()), "shape": [height, width, 3]}}]}


FILES = {"inputs.json": image_inputs, "pixels.json": pixel_inputs}


def main() -> None:
    for name, build in FILES.items():
        (HERE / name).write_text(json.dumps(build(), separators=(",", ":")) + "\n")
        print(f"wrote {HERE / name}")


if __name__ == "__main__":
    main()
