"""One BentoML service per model: ``primary`` (PyTorch) and ``fallback`` (ONNX Runtime).

``engines`` holds the framework-only inference code (no BentoML), shared with the
model import checks; ``common`` holds the bucketed, adaptive-batching API both
runner services expose.
"""
