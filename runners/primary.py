"""The primary runner: a PyTorch classifier (EfficientNet-Lite2 by default).

CUDA when ``torch.cuda.is_available()`` (channels_last, fp16 autocast), CPU
otherwise. One batchable API per size bucket, settings ``primary_*``; see
``runners.common.define_runner``.
"""

from runners.common import define_runner

Primary = define_runner("primary", "Primary", "EfficientNet-Lite2 (or an imported PyTorch model) behind adaptive batching.")
