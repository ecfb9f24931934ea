"""Response models of the Rampart API (pydantic)."""

from __future__ import annotations

from pydantic import BaseModel, Field

__all__ = ["Label", "ModelInfo", "Timings", "Prediction"]


class Label(BaseModel):
    """One class: ImageNet-1k ``index``, human ``label`` and probability ``score`` (0..1)."""

    index: int
    label: str
    score: float


class ModelInfo(BaseModel):
    """The model that answered: store ``name`` and ``version``."""

    name: str
    version: str


class Timings(BaseModel):
    """Stage timings in milliseconds, measured by the server (docs/api.md, the answer's ``timings_ms``).

    ``before_handler``: from the request's arrival (its first byte, or a load balancer's ``X-Request-Start``) to
    the handler's start; then, once the body is read: ``decode``; ``inference``: the answering model's batch;
    ``queue``: the rest, waiting for admission and for a model that did not answer (a primary that timed out)
    included; ``total``: decode + queue + inference. ``before_handler`` is None from servers older than the field.
    """

    decode: float
    queue: float
    inference: float
    total: float
    before_handler: float | None = None


class Prediction(BaseModel):
    """A ``200`` answer of ``/classify``.

    ``labels`` are sorted by score, highest first. ``degraded`` is true when the
    fallback (or the static default) answered, and ``degraded_reason`` says why;
    ``needs_review`` is true when no model could answer (``labels`` is then empty).
    ``input_warnings`` names benign damage the server repaired to decode the upload
    (e.g. ``["jpeg_missing_eoi"]``); empty for an undamaged file. ``route`` says how a model
    answer was reached (``primary_first``, or in cascade mode ``cascade_confident``,
    ``cascade_escalated``, ``cascade_not_escalated``, ``cascade_fallback_unavailable``);
    None when no model answered now, and from servers older than the field.
    """

    request_id: str
    labels: list[Label]
    model: ModelInfo | None
    degraded: bool
    degraded_reason: str | None
    route: str | None = None
    needs_review: bool = False
    bucket: str | None = None
    timings_ms: Timings
    input_warnings: list[str] = Field(default_factory=list)

    @property
    def top(self) -> Label | None:
        """The most probable label, or None for the static default answer."""
        return self.labels[0] if self.labels else None
