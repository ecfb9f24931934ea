"""What both test layers share: the repository root, real sample photos and their right answers, encoding."""

from __future__ import annotations

import io
import re
import time
from pathlib import Path

import numpy as np
from PIL import Image

from bench.loadgen import DEADLINE_SLACK_MS

ROOT = Path(__file__).resolve().parents[2]

#: ImageNet-1k indices that count as a right answer for each sample photo.
CAT = {281, 282, 283, 284, 285}
COFFEE = {967, 968, 504}
ROCKET = {812, 657, 744}  # space shuttle, missile, projectile
CHINA = {698, 663, 538, 668, 449, 975}  # palace, monastery, dome, mosque, boathouse, lakeside

PHOTOS = {"chelsea": CAT, "coffee": COFFEE, "rocket": ROCKET, "china": CHINA}

SLACK_MS = DEADLINE_SLACK_MS  # the documented slack beyond a deadline (bench/loadgen.py)


def photo(name: str) -> np.ndarray:
    """A real sample photo as uint8 H×W×3: skimage's chelsea/coffee/rocket, sklearn's china."""
    if name == "china":
        from sklearn.datasets import load_sample_image

        return load_sample_image("china.jpg")
    from skimage import data

    return getattr(data, name)()


def encode(array_or_image, fmt: str = "JPEG", **save_kwargs) -> bytes:
    """Encode a uint8 array or PIL image to bytes in ``fmt``."""
    image = array_or_image if isinstance(array_or_image, Image.Image) else Image.fromarray(array_or_image)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save_kwargs)
    return buffer.getvalue()


def logged_lines(server, marker: str, count: int = 1, timeout_s: float = 10.0) -> list[str]:
    """The lines of ``server``'s log that contain ``marker``, once ``count`` of them are there (the log read every
    0.05 s, for at most ``timeout_s``: an access line is written by a writer thread after its answer is sent,
    ``rampart.telemetry.accesslog``); what is there at the end, fewer if they never came."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [line for line in server.log_path.read_text(errors="replace").splitlines() if marker in line]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def server_timing(response) -> dict[str, float]:
    """A response's ``Server-Timing`` header as ``{stage: milliseconds}`` (``name;dur=ms`` entries, comma-separated)."""
    return {name: float(ms) for name, ms in re.findall(r"(\w+);dur=([\d.]+)", response.headers["Server-Timing"])}
