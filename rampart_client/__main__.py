"""The ``rampart-client`` command (also ``python -m rampart_client``).

``rampart-client classify IMG... [--url URL] [--top-k K] [--deadline-ms MS] [--priority high|normal|low]
[--timeout S] [--json]`` prints each image's top labels, one line per label, or with ``--json``
one JSON document: a list with one object per image, in order, ``{"image", "prediction"}``
(the server's answer) or ``{"image", "error": {"type", "status", "code", "message"}}``.
Exits 0 when every image was classified, 1 when any failed, 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import Client, RampartClientError
from .client import DEFAULT_TIMEOUT_S, PRIORITIES, server_url

PROG = "rampart-client"
DEFAULT_URL = "http://127.0.0.1:3000"


def _server_url(text: str) -> str:
    """``--url`` (or ``RAMPART_URL``): ``rampart_client.client.server_url``'s checks; else argparse's usage error."""
    try:
        return server_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_seconds(text: str) -> float:
    """``--timeout``: a positive finite number of seconds (``-1`` ended in httpx's traceback, ``0`` in a confusing
    connection error); else argparse's usage error, exit status 2."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number of seconds, got {text}")
    return seconds


def parser() -> argparse.ArgumentParser:
    """The command line: ``classify`` with its options, every one with help and its default shown."""
    formatter = argparse.ArgumentDefaultsHelpFormatter
    top = argparse.ArgumentParser(prog=PROG, formatter_class=formatter,
                                  description="Command-line client of a Rampart image-classification server.",
                                  epilog="Run 'rampart-client classify --help' for the options of classify.")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND", help="the command to run")
    classify = commands.add_parser(
        "classify", formatter_class=formatter, help="classify image files",
        description="Send each image to POST /classify and print its top labels.",
        epilog="Exit status: 0 every image classified, 1 any image failed, 2 a bad command line.")
    classify.add_argument("images", nargs="+", metavar="IMAGE",
                          help="image files (JPEG, PNG, GIF, WEBP, BMP or TIFF)")
    classify.add_argument("--url", type=_server_url, default=os.environ.get("RAMPART_URL", DEFAULT_URL),
                          help="the server's base URL (default from RAMPART_URL when set)")
    classify.add_argument("--top-k", type=int, default=5, help="labels per image, 1..20")
    classify.add_argument("--deadline-ms", type=float, default=None,
                          help="end-to-end deadline per image in ms (X-Deadline-Ms); none: the server's "
                               "default_deadline_ms")
    classify.add_argument("--priority", choices=PRIORITIES, default=None,
                          help="X-Priority; none: the server's default, normal")
    classify.add_argument("--timeout", type=_positive_seconds, default=DEFAULT_TIMEOUT_S,
                          help="HTTP timeout per request, s")
    classify.add_argument("--json", action="store_true",
                          help="print one JSON document (a list, one object per image) instead of text")
    return top


def _error(exc: Exception) -> dict:
    return {"type": type(exc).__name__, "status": getattr(exc, "status", None), "code": getattr(exc, "code", ""),
            "message": getattr(exc, "message", str(exc))}


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = parser().parse_args(argv)
    if args.deadline_ms is not None and args.timeout * 1000 < args.deadline_ms:
        # The client would give up first: the server's answer at its deadline (degraded, or a clear 429) is lost.
        print(f"warning: --timeout {args.timeout:g} s is shorter than --deadline-ms {args.deadline_ms:g}: the client "
              "gives up before the server's answer at the deadline; set --timeout above the deadline", file=sys.stderr)
    failed, documents = 0, []
    with Client(args.url, timeout=args.timeout) as client:
        for path in args.images:
            try:
                prediction = client.classify(path, top_k=args.top_k, deadline_ms=args.deadline_ms, priority=args.priority)
            except (RampartClientError, OSError) as exc:
                failed += 1
                if args.json:
                    documents.append({"image": path, "error": _error(exc)})
                else:
                    print(f"{path}: error: {exc}", file=sys.stderr)
                continue
            if args.json:
                documents.append({"image": path, "prediction": prediction.model_dump(mode="json")})
                continue
            note = f" (degraded: {prediction.degraded_reason})" if prediction.degraded else ""
            if prediction.input_warnings:
                note += f" (repaired: {', '.join(prediction.input_warnings)})"
            model = prediction.model.name if prediction.model else "none"
            print(f"{path}: {model}{note}")
            for label in prediction.labels:
                print(f"  {label.score:6.3f}  {label.label}")
    if args.json:
        json.dump(documents, sys.stdout, indent=2)
        print()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
