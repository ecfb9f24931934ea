"""Rampart's serving logic, grouped by concern; framework-free but for the HTTP layer.

- ``rampart.api``: the HTTP layer (Starlette app and routes, request parsing, the Open
  Inference Protocol, start-up and drain, BentoML/uvicorn adapters and fixes). The
  only subpackage that imports BentoML (``bentoml_api`` at module level,
  ``bentoml_fixes`` inside each patch function) or knows about uvicorn.
- ``rampart.inputs``: upload bytes to model inputs (decoding, decode cost, repair,
  buckets, the decode worker pool).
- ``rampart.overload``: admission gates and throughput meter, circuit breaker,
  deadline slices, event-loop lag.
- ``rampart.telemetry``: Prometheus metrics and the JSON access log.
- top level: the request chain (``pipeline``), one model as the chain drives it
  (``lane``), the answer cache (``cache``), result shaping (``results``),
  configuration (``config``), the error tree (``errors``), fault injection (``faults``).

Everything outside ``rampart.api`` is plain Python, unit-tested without a server
(``tests/unit``) and reused by the service, the runners and the tools.
"""
