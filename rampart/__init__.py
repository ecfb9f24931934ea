"""Rampart's framework-free serving logic.

Nothing in this package imports BentoML: decoding, size buckets, deadlines,
fault injection, result shaping and configuration are plain Python, so they
are unit-tested without a server and reused by the service, the runners and
the tools.
"""
