"""One BentoML service per model: ``primary`` (PyTorch) and ``fallback`` (ONNX Runtime).

``common`` holds the bucketed, adaptive-batching API both runner services expose;
the framework-only inference code they wrap (architectures, engines) lives in
``inference``, shared with the model import in ``models``.
"""
