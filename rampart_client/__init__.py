"""Python client SDK for Rampart.

``Client`` / ``AsyncClient`` call a Rampart server; ``Prediction`` is the answer;
``ImageRejected`` (4xx), ``Overloaded`` (429, ``retry_after``) and ``ServiceError``
are the errors. ``python -m rampart_client classify IMG...`` prints top labels.
"""

from .client import AsyncClient, Client
from .errors import ImageRejected, Overloaded, RampartClientError, ServiceError
from .models import Label, ModelInfo, Prediction, Timings

__all__ = [
    "Client",
    "AsyncClient",
    "Prediction",
    "Label",
    "ModelInfo",
    "Timings",
    "RampartClientError",
    "ImageRejected",
    "Overloaded",
    "ServiceError",
]
