"""``rampart.errors`` and the SDK's ``rampart_client.errors``: every error class Rampart answers with has a unique
code and a proper status, is documented in docs/api.md's error table and is mapped by the SDK."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

import rampart_client.errors as client_errors
from rampart import errors
from rampart_client.client import error_from_body, parse_batch
from tests.support import ROOT

API_DOC = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()


def expected_client_error(status: int) -> type[client_errors.RampartClientError]:
    """What the SDK promises for a status (rampart_client/errors.py)."""
    if status == 429:
        return client_errors.Overloaded
    return client_errors.ImageRejected if 400 <= status < 500 else client_errors.ServiceError


def test_error_classes_are_every_leaf_of_the_tree_with_unique_codes():
    leaves = {cls for cls in vars(errors).values()
              if isinstance(cls, type) and issubclass(cls, errors.RampartError) and not cls.__subclasses__()}
    assert set(errors.ERROR_CLASSES) == leaves
    codes = [cls.code for cls in errors.ERROR_CLASSES]
    assert len(codes) == len(set(codes))
    assert not {errors.RampartError, errors.RequestError, errors.ImageError, errors.Unavailable} & leaves


@pytest.mark.parametrize("cls", errors.ERROR_CLASSES, ids=lambda cls: cls.code)
def test_every_error_class_has_a_row_in_the_api_doc_s_error_table(cls):
    row = rf"^\| {cls.status} \| `{cls.code}` \|"
    assert re.search(row, API_DOC, re.MULTILINE), f"docs/api.md's error table has no row for {cls.status} {cls.code}"


@pytest.mark.parametrize("cls", errors.ERROR_CLASSES, ids=lambda cls: cls.code)
def test_the_sdk_maps_every_error_on_its_status_alone_and_in_a_batch(cls):
    body = cls("message").to_body("rid")
    whole = error_from_body(cls.status, body, httpx.Headers({"retry-after": "2"}))
    batch = httpx.Response(200, json={"request_id": "rid", "results": [
        {"index": 0, "filename": "a.jpg", "status": cls.status, **body}]})
    (in_batch,) = parse_batch(batch)
    for error in (whole, in_batch):
        assert type(error) is expected_client_error(cls.status)
        assert (error.status, error.code, error.request_id) == (cls.status, cls.code, "rid")


def test_every_error_has_a_unique_code_and_a_proper_status():
    codes = [cls.code for cls in errors.ERROR_CLASSES]
    assert len(codes) == len(set(codes))
    for cls in errors.ERROR_CLASSES:
        if issubclass(cls, errors.RequestError):
            assert 400 <= cls.status < 500 and cls.status != 429
    assert errors.Overloaded.status == 429 and errors.InternalError.status == 500
    api_doc = (ROOT / "docs" / "api.md").read_text()
    missing = [code for code in codes if f"`{code}`" not in api_doc]
    assert not missing, f"error codes not documented in docs/api.md: {missing}"
