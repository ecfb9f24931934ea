"""What Rampart tells its operators: Prometheus metrics (``metrics``), the one JSON access-log line per request
(``accesslog``), and what keeps ``/stats`` and ``/metrics`` cheap under a storm of scrapes (``scrapes``)."""
