"""``python -m rampart_client classify IMG... [--url URL] [--top-k K] [--deadline-ms MS] [--priority high]``.

Prints each image's top labels, one line per label; exits 1 if any image failed.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import Client, RampartClientError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rampart_client", description="Rampart command-line client")
    commands = parser.add_subparsers(dest="command", required=True)
    classify = commands.add_parser("classify", help="classify image files")
    classify.add_argument("images", nargs="+", help="image files")
    classify.add_argument("--url", default=os.environ.get("RAMPART_URL", "http://127.0.0.1:3000"))
    classify.add_argument("--top-k", type=int, default=5)
    classify.add_argument("--deadline-ms", type=float, default=None)
    classify.add_argument("--priority", choices=("high", "normal"), default=None)
    args = parser.parse_args(argv)

    failed = 0
    with Client(args.url) as client:
        for path in args.images:
            try:
                prediction = client.classify(path, top_k=args.top_k, deadline_ms=args.deadline_ms, priority=args.priority)
            except (RampartClientError, OSError) as exc:
                print(f"{path}: error: {exc}", file=sys.stderr)
                failed += 1
                continue
            note = f" (degraded: {prediction.degraded_reason})" if prediction.degraded else ""
            if prediction.input_warnings:
                note += f" (repaired: {', '.join(prediction.input_warnings)})"
            model = prediction.model.name if prediction.model else "none"
            print(f"{path}: {model}{note}")
            for label in prediction.labels:
                print(f"  {label.score:6.3f}  {label.label}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
