"""The shadow runner: a candidate model that gets mirrored traffic (docs/overload.md, "Shadow traffic").

Started by ``bentoml serve`` only when ``shadow_model`` names a model in the store
(``service.Rampart`` depends on it only then). The engine follows the stored
model's metadata, as written by ``python -m models.import_models``: ``framework``
"onnx" runs ``model.onnx`` on ONNX Runtime (as the fallback does), "pytorch" builds
``family``/``arch`` and loads ``weights.pt`` (as the primary does). Same bucketed
adaptive-batching API as both runners (``runners.common``), at ``shadow_nice``, with
batches of at most ``shadow_max_inflight`` (never more items than that are sent),
and its own fault injection (``fault_shadow_*``).
"""

from runners.common import define_runner

Shadow = define_runner("shadow", "Shadow", "A candidate model (ONNX or PyTorch) behind adaptive batching, for mirrored requests only.")
