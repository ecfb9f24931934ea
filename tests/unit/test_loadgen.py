"""``bench.loadgen``'s Open Inference Protocol wire (``oip_request`` / ``oip_answer``), the load generator's side of
the Triton baseline of ``bench.load_bench`` (``bench.baselines.triton_pytriton``: tests/unit/test_triton_pytriton.py),
read back with ``rampart.api.oip`` and ``tritonclient``; no server."""

from __future__ import annotations

import json

import pytest
import tritonclient.http as triton

from bench.loadgen import oip_answer, oip_request
from rampart.api import oip
from tests.support import encode, photo
from tests.support.oip import answer, texts

#: A real answer of the Triton baseline (Triton 2.51.0 under PyTriton 0.7.0) to ``oip_request`` of the chelsea photo.
TRITON_ANSWER = (
    b'{"model_name":"classifier","model_version":"1","outputs":[{"name":"LABELS","datatype":"BYTES","shape":[1,5],'
    b'"data":["Egyptian cat","tiger cat","tabby","lynx","fox squirrel"]},{"name":"SCORES","datatype":"FP32",'
    b'"shape":[1,5],"data":[0.76780104637146,0.052257638424634936,0.04419192671775818,0.01892322301864624,'
    b'0.0010521160438656808]},{"name":"CLASS_INDICES","datatype":"INT64","shape":[1,5],'
    b'"data":[285,282,281,287,335]}]}'
)


def test_oip_request_is_one_raw_image_in_the_binary_extension_with_json_outputs():
    image = encode(photo("chelsea"))
    body, headers = oip_request(image)
    parsed = oip.parse_infer_request(body, headers[oip.HEADER_LENGTH], oip.Limits(1, len(image), 50_000_000))
    assert parsed.images == [image]
    assert parsed.outputs == [(name, False) for name in oip.TOP_K_OUTPUTS] and not parsed.binary_output
    assert len(body) == int(headers[oip.HEADER_LENGTH]) + 4 + len(image)  # no base64: the bytes as they are
    assert headers["Accept-Encoding"] == "identity"


def test_oip_answer_reads_a_triton_answer_as_tritonclient_does():
    ours = oip_answer(json.loads(TRITON_ANSWER))
    theirs = triton.InferenceServerClient.parse_response_body(TRITON_ANSWER)
    assert [entry["label"] for entry in ours["labels"]] == texts(theirs.as_numpy(oip.LABELS))[0]
    assert [entry["index"] for entry in ours["labels"]] == theirs.as_numpy(oip.CLASS_INDICES)[0].tolist()
    assert [entry["score"] for entry in ours["labels"]] == pytest.approx(theirs.as_numpy(oip.SCORES)[0].tolist())
    assert ours["model"] == {"name": "classifier"} and ours["degraded_reason"] is None


@pytest.mark.parametrize("result, model, reason", [
    (answer([(285, "Egyptian cat", 0.5), (281, "tabby", 0.25)]), {"name": "rampart-primary"}, None),
    (answer([], "no_model_available"), None, "no_model_available"),
], ids=["answered", "unanswered"])
def test_oip_answer_reads_rampart_v2_answers(result, model, reason):
    """Rampart's own ``/v2`` answer: the model and the degraded reason come from the outputs ``MODEL`` and
    ``DEGRADED_REASON``, padding entries (index -1) are no labels."""
    parsed = oip.InferRequest(None, [b""], {}, [(name, False) for name in oip.OUTPUT_DATATYPES], False)
    response = oip.encode_infer_response(parsed, [result], 5, "req-1", "v")
    ours = oip_answer(triton.InferenceServerClient.parse_response_body(response.body).get_response())
    assert ours["labels"] == result["labels"] and ours["model"] == model and ours["degraded_reason"] == reason
