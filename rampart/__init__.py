"""Rampart's serving logic, framework-free but for two BentoML adapters.

Decoding, size buckets, deadlines, fault injection, result shaping,
configuration and the other policy modules are plain Python, so they are
unit-tested without a server and reused by the service, the runners and the
tools. Two modules import BentoML, and only ``service.py`` imports them:
``bentoml_api`` (the IO descriptor behind BentoML's client and ``/docs``) and
``bentoml_fixes`` (patches for BentoML 1.4.29 defects; it imports BentoML
inside each patch function).
"""
