"""The fallback runner: an ONNX Runtime classifier (EfficientNet-Lite0 by default).

``CUDAExecutionProvider`` when a GPU is present, ``CPUExecutionProvider``
otherwise. One batchable API per size bucket, settings ``fallback_*``; see
``runners.common.define_runner``.
"""

from runners.common import define_runner

Fallback = define_runner("fallback", "Fallback", "EfficientNet-Lite0 in ONNX (or an imported ONNX model) behind adaptive batching.")
