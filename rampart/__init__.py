"""Rampart's serving logic, grouped by concern; framework-free but for the HTTP layer.

- ``rampart.api``: the HTTP layer (Starlette app and routes, request parsing, the Open
  Inference Protocol, start-up and drain, the BentoML API view). It uses BentoML's public
  API only (``bentoml_api`` at module level, ``app`` inside ``api_worker`` for the
  worker's index).
- ``rampart.compat``: every patch of a BentoML, uvicorn or circus internal, the check that
  the pinned versions are installed, and the only imports of their private modules
  (docs/compat.md).
- ``rampart.inputs``: upload bytes to model inputs (decoding, decode cost, repair,
  buckets, the decode worker pool).
- ``rampart.overload``: admission gates and throughput meter, circuit breaker,
  deadline slices, event-loop lag.
- ``rampart.telemetry``: Prometheus metrics and the JSON access log.
- top level: the request chain (``pipeline``), one model as the chain drives it
  (``lane``), the answer cache (``cache``), result shaping (``results``),
  configuration (``config``), CPU placement of each process (``cores``: niceness and
  core pinning), the error tree (``errors``), fault injection (``faults``) and
  shadow traffic to a candidate model (``shadow``).

Everything outside ``rampart.api`` is plain Python, unit-tested without a server
(``tests/unit``) and reused by the service, the runners and the tools.
"""
