"""Python client SDK for Rampart.

``Client`` / ``AsyncClient`` call a Rampart server; ``Prediction`` is the answer;
``ImageRejected`` (4xx), ``Overloaded`` (429, ``retry_after``) and ``ServiceError``
are the errors (``ConnectionFailed`` and ``ClientTimeout``, no answer at all, are ``ServiceError``s); ``BackoffPolicy`` sets the client's adaptive throttling and retries
(``Throttled``: refused locally). ``python -m rampart_client classify IMG...`` prints top labels.
"""

from .backoff import BackoffPolicy
from .client import PRIORITIES, AsyncClient, Client
from .errors import ClientTimeout, ConnectionFailed, ImageRejected, Overloaded, RampartClientError, ServiceError, Throttled
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
    "Throttled",
    "ServiceError",
    "ConnectionFailed",
    "ClientTimeout",
    "BackoffPolicy",
    "PRIORITIES",
]
