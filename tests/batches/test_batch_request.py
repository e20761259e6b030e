"""A request to create a batch is checked as it is made, whether it is read from the API's
JSON or built in code: a BatchError names the first field at fault."""

from __future__ import annotations

import pytest

from controlplane.batches.errors import BatchError
from controlplane.batches.intake import BatchRequest


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input_file_id"),
    ({"input_file_id": 7, "endpoint": "/v1/chat/completions"}, "input_file_id"),
    ({"input_file_id": "file-1", "endpoint": "/v1/embeddings"}, "endpoint"),
    ({"input_file_id": "file-1", "endpoint": ["/v1/completions"]}, "endpoint"),
    ({"input_file_id": "file-1", "endpoint": "/v1/completions", "completion_window": "1h"},
     "completion_window"),
    ({"input_file_id": "file-1", "endpoint": "/v1/completions", "completion_window": {}},
     "completion_window"),
    ({"input_file_id": "file-1", "endpoint": "/v1/completions", "completion_window": "24h",
      "metadata": {"k": 1}}, "metadata"),
    ({"input_file_id": "", "endpoint": "/v1/embeddings", "completion_window": "1h"},
     "input_file_id"),
])
def test_the_first_bad_field_is_named(body: dict[str, object], param: str) -> None:
    with pytest.raises(BatchError) as refused:
        BatchRequest.from_body(body)
    assert refused.value.param == param


def test_a_request_built_in_code_is_checked_too() -> None:
    with pytest.raises(BatchError) as refused:
        BatchRequest("file-1", "/v1/embeddings")
    assert refused.value.param == "endpoint"
    made = BatchRequest.from_body({"input_file_id": "file-1", "endpoint": "/v1/completions",
                                   "completion_window": "24h", "metadata": {"team": "a"}})
    assert made == BatchRequest("file-1", "/v1/completions", "24h", {"team": "a"})
