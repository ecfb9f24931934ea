"""Framework-only inference code, shared by ``runners/`` (serving) and ``models/`` (import).

``architectures`` rebuilds a PyTorch module from an architecture name; ``engines``
turns uint8 N×H×W×3 batches into N×C float32 probabilities with PyTorch or ONNX
Runtime. Nothing here imports BentoML, ``runners`` or ``models``; torch and
onnxruntime are imported where they are used (``architectures`` imports torch at
module level).
"""
