"""BentoML's own client (``bentoml.SyncHTTPClient`` 1.4.29) and OpenAPI page against a real server,
used as a BentoML user would (docs/clients.md, "BentoML's client")."""

from __future__ import annotations

import io
import json

import bentoml
import pytest
from PIL import Image

from rampart.api.bentoml_api import CLASSIFY_API_ROUTE, CLASSIFY_BATCH_API_ROUTE
from tests.support import PHOTOS, encode, photo


def right(answer: dict, name: str) -> bool:
    return bool({label["index"] for label in answer["labels"]} & PHOTOS[name])


@pytest.fixture
def photos(tmp_path):
    paths = {}
    for name in ("coffee", "chelsea"):
        paths[name] = tmp_path / f"{name}.jpg"
        paths[name].write_bytes(encode(photo(name)))
    paths["junk"] = tmp_path / "junk.jpg"
    paths["junk"].write_bytes(b"not an image")
    return paths


def test_classify_takes_a_path_a_pil_image_and_top_k(server, photos):
    coffee = photos["coffee"]
    with bentoml.SyncHTTPClient(server.url, timeout=60) as bento:
        answers = [bento.classify(coffee), bento.classify(str(coffee)), bento.classify(image=coffee, top_k=2),
                   bento.classify(Image.open(coffee)), bento.classify(Image.open(io.BytesIO(coffee.read_bytes())), 3)]
        with pytest.raises(bentoml.exceptions.BentoMLException) as too_many:
            bento.classify(coffee, top_k=50)
    assert [len(answer["labels"]) for answer in answers] == [5, 5, 2, 5, 3]
    assert all(right(answer, "coffee") and answer["degraded_reason"] is None for answer in answers), answers
    assert too_many.value.error_code == 422
    assert json.loads(str(too_many.value))["error"]["code"] == "invalid_parameter"


def test_bytes_and_open_files_stop_inside_bentoml_s_client_before_any_request(server, photos):
    """BentoML 1.4.29's ``HTTPClient._get_file`` asserts ``isinstance(value, typing.BinaryIO)``, which no
    ``bytes`` or real file passes, for any file field; the documented way is a path or a PIL image. When
    BentoML fixes it, this test fails: then document bytes and open files as accepted."""
    with bentoml.SyncHTTPClient(server.url, timeout=60) as bento, open(photos["coffee"], "rb") as file:
        for value in (photos["coffee"].read_bytes(), file):
            with pytest.raises(AssertionError):
                bento.classify(value)
        assert right(bento.classify(Image.open(file)), "coffee")  # the documented wrapper of an open file


def test_classify_batch_is_listed_and_keeps_each_image_s_error_in_place(server, photos):
    with bentoml.SyncHTTPClient(server.url, timeout=60) as bento:
        assert {"classify", "classify_batch"} <= set(bento.endpoints)
        answer = bento.classify_batch(images=[photos["coffee"], photos["junk"], Image.open(photos["chelsea"])],
                                      top_k=3)
    first, junk, cat = answer["results"]
    assert [entry["index"] for entry in answer["results"]] == [0, 1, 2]
    assert len(first["labels"]) == 3 and right(first, "coffee") and right(cat, "chelsea")
    assert (junk["status"], junk["error"]["code"]) == (415, "unsupported_format")


def test_docs_redirects_to_bentoml_s_openapi_page_which_lists_both_apis(http):
    page = http.get("/docs", follow_redirects=False)
    assert page.status_code == 307 and page.headers["location"] == "/"
    ui = http.get("/docs", follow_redirects=True)
    assert ui.status_code == 200 and "swagger" in ui.text.lower()
    spec = http.get("/docs.json").json()
    for route, files in ((CLASSIFY_API_ROUTE, "image"), (CLASSIFY_BATCH_API_ROUTE, "images")):
        schema = spec["paths"][route]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
        assert {files, "top_k"} <= set(schema["properties"]), schema


def test_multipart_top_k_field_on_classify_itself(http):
    """What ``curl -F image=@coffee.jpg -F top_k=2 $URL/classify`` sends; with the query parameter too, 422."""
    files = {"image": ("coffee.jpg", encode(photo("coffee")), "image/jpeg")}
    answer = http.post("/classify", files=files, data={"top_k": "2"})
    assert answer.status_code == 200 and len(answer.json()["labels"]) == 2
    both = http.post("/classify?top_k=2", files=files, data={"top_k": "2"})
    assert both.status_code == 422 and both.json()["error"]["code"] == "invalid_parameter"


@pytest.mark.parametrize("route", [CLASSIFY_API_ROUTE, CLASSIFY_BATCH_API_ROUTE])
@pytest.mark.parametrize("content_type", ["application/vnd.bentoml+pickle", "application/vnd.bentoml+pickle; x=1"])
def test_a_pickle_body_on_bentoml_s_routes_gets_rampart_s_json_415(http, route, content_type):
    """BentoML's handler refuses its runner serialisation on the entry service in its own error shape, with a
    logged traceback; Rampart answers first, in its shape, and the next upload is classified."""
    response = http.post(route, content=b"\x80\x04K\x01.", headers={"Content-Type": content_type})
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert error["code"] == "unsupported_format" and error["request_id"] == response.headers["x-request-id"]
    answer = http.post("/classify", content=encode(photo("chelsea")))
    assert answer.status_code == 200 and {label["index"] for label in answer.json()["labels"]} & PHOTOS["chelsea"]
