"""What Rampart tells its operators: Prometheus metrics (``metrics``) and the one JSON access-log line per request (``accesslog``)."""
