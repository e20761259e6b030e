"""The Batch API through its HTTP endpoints: upload, create, run against engines, results in
OpenAI's line format; retries, residency, exactly-once results, cancel; and every bad input
answered with what is wrong and nothing half-written."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.http import StreamingHttpResponse
from django.test import Client

from controlplane.batches import runner, transport
from controlplane.batches.models import Batch, BatchFile, BatchLine, LineState

from .conftest import drive, jsonl, line

pytestmark = pytest.mark.django_db


def client(key: str) -> Client:
    return Client(HTTP_AUTHORIZATION=f"Bearer {key}")


def upload(c: Client, content: bytes, name: str = "in.jsonl", purpose: str = "batch") -> Any:
    from django.core.files.uploadedfile import SimpleUploadedFile

    return c.post("/v1/files", {"purpose": purpose,
                                "file": SimpleUploadedFile(name, content)})


def create(c: Client, file_id: str, endpoint: str = "/v1/chat/completions", **extra: Any) -> Any:
    return c.post("/v1/batches", json.dumps({"input_file_id": file_id, "endpoint": endpoint,
                                             "completion_window": "24h", **extra}),
                  content_type="application/json")


def output_lines(c: Client, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    response = c.get(f"/v1/files/{file_id}/content")
    assert response.status_code == 200
    assert isinstance(response, StreamingHttpResponse)  # sent a chunk at a time
    content = b"".join(response.streaming_content)
    assert len(content) == int(response["Content-Length"])
    return [json.loads(raw) for raw in content.splitlines()]


def test_a_batch_runs_retries_and_writes_output_and_error_files(fleet: Any) -> None:
    c = client(fleet["acme"])
    uploaded = upload(c, jsonl(line("a", "hello"), line("b", "fail-2"), line("c", "bad"),
                               line("d", "busy-1"), line("e", "slow")))
    assert uploaded.status_code == 200, uploaded.content
    file_id = uploaded.json()["id"]
    assert uploaded.json()["bytes"] > 0 and uploaded.json()["purpose"] == "batch"
    created = create(c, file_id, metadata={"job": "nightly"})
    assert created.status_code == 200, created.content
    batch = created.json()
    assert batch["status"] == "validating" and batch["id"].startswith("batch_")
    assert batch["request_counts"] == {"total": 5, "completed": 0, "failed": 0}
    assert fleet["sent"] == [("batches.run_batch", (batch["id"],), {})]

    drive(batch["id"])

    done = c.get(f"/v1/batches/{batch['id']}").json()
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 5, "completed": 3, "failed": 2}
    assert done["metadata"] == {"job": "nightly"}
    assert done["completed_at"] >= done["in_progress_at"] >= done["created_at"]
    ok = output_lines(c, done["output_file_id"])
    assert [row["custom_id"] for row in ok] == ["a", "b", "d"]
    first = ok[0]
    assert first["error"] is None and first["id"].startswith("batch_req_")
    assert first["response"]["status_code"] == 200
    assert first["response"]["request_id"].startswith("req_")
    assert first["response"]["body"]["choices"][0]["message"]["content"] == "re: hello"
    errors = {row["custom_id"]: row for row in output_lines(c, done["error_file_id"])}
    assert set(errors) == {"c", "e"}
    assert errors["c"]["response"]["status_code"] == 400        # a 4xx is final: sent once
    assert errors["c"]["error"]["code"] == "http_400"
    assert errors["e"]["response"] is None                      # timed out on every attempt
    assert errors["e"]["error"]["code"] == "request_failed"
    prompts = fleet["eu"].prompts()
    # 5xx and 429 retried until answered; timeouts up to the attempt limit (3); 400 once
    assert {p: prompts.count(p) for p in set(prompts)} == {
        "hello": 1, "fail-2": 3, "busy-1": 2, "bad": 1, "slow": 3}
    assert fleet["us"].prompts() == []                          # acme may use the EU only
    request = fleet["eu"].requests[0]
    assert request["path"] == "/v1/chat/completions" and request["body"]["stream"] is False

    # Running it again sends nothing: every line has its result.
    drive(batch["id"])
    assert len(fleet["eu"].prompts()) == len(prompts)


def test_a_result_is_stored_once_and_a_finished_line_is_never_claimed_again(
        fleet: Any, batch_settings: Any) -> None:
    c = client(fleet["acme"])
    file_id = upload(c, jsonl(*(line(f"id-{i}", f"p{i}") for i in range(6)))).json()["id"]
    batch = Batch.objects.get(pk=create(c, file_id).json()["id"])
    first = runner.claim(batch, "w1", 4)
    second = runner.claim(batch, "w2", 4)
    assert [x.custom_id for x in first] == ["id-0", "id-1", "id-2", "id-3"]
    assert [x.custom_id for x in second] == ["id-4", "id-5"]    # never a line w1 holds
    assert runner.claim(batch, "w3", 4) == []
    answer = transport.Outcome(200, {"n": 1}, "req_1")
    assert runner.record(first[0], "w1", answer) is True
    assert runner.record(first[0], "w1", transport.Outcome(200, {"n": 2}, "req_2")) is False
    assert runner.record(first[0], "w1", transport.Outcome(500, None, "req_3")) is False
    stored = BatchLine.objects.get(batch=batch, custom_id="id-0")
    assert stored.result == {"n": 1} and stored.state == LineState.DONE
    # w1 and w2 die holding their lines: once the lease has run out another worker takes them.
    batch_settings.BATCH_LEASE_S = 0
    drive(batch.pk)
    assert "p0" not in fleet["eu"].prompts()                    # its result was already stored
    assert len(fleet["eu"].prompts()) == 5


def test_cancel_stops_new_sends_keeps_finished_results_and_refuses_once_finished(
        fleet: Any, batch_settings: Any) -> None:
    batch_settings.BATCH_CHUNK = 2
    c = client(fleet["acme"])
    file_id = upload(c, jsonl(*(line(f"id-{i}", f"p{i}") for i in range(6)))).json()["id"]
    batch_id = create(c, file_id).json()["id"]
    assert runner.process(batch_id, "w1", budget_s=0.0) == 0.0    # one chunk, then yields
    cancelled = c.post(f"/v1/batches/{batch_id}/cancel")
    assert cancelled.status_code == 200, cancelled.content
    body = cancelled.json()
    assert body["status"] == "cancelled" and body["cancelled_at"] is not None
    assert body["request_counts"] == {"total": 6, "completed": 2, "failed": 0}
    assert [row["custom_id"] for row in output_lines(c, body["output_file_id"])] == \
        ["id-0", "id-1"]
    drive(batch_id)
    assert sorted(fleet["eu"].prompts()) == ["p0", "p1"]
    again = c.post(f"/v1/batches/{batch_id}/cancel")
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "batch_finished"
    assert "already cancelled" in again.json()["error"]["message"]


def test_listing_pages_with_after_and_limit(fleet: Any) -> None:
    c = client(fleet["acme"])
    file_id = upload(c, jsonl(line("a", "x"))).json()["id"]
    ids = [create(c, file_id).json()["id"] for _ in range(3)]
    page = c.get("/v1/batches?limit=2").json()
    assert page["object"] == "list" and page["has_more"] is True
    assert [b["id"] for b in page["data"]] == ids[::-1][:2]
    rest = c.get(f"/v1/batches?limit=2&after={page['last_id']}").json()
    assert [b["id"] for b in rest["data"]] == [ids[0]] and rest["has_more"] is False
    assert c.get("/v1/batches?limit=0").status_code == 400


def test_keys_see_only_their_tenants_files_and_batches(fleet: Any) -> None:
    acme, globex = client(fleet["acme"]), client(fleet["globex"])
    file_id = upload(acme, jsonl(line("a", "x"))).json()["id"]
    batch_id = create(acme, file_id).json()["id"]
    for url in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content",
                f"/v1/batches/{batch_id}"):
        response = globex.get(url)
        assert response.status_code == 404, url
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert globex.post(f"/v1/batches/{batch_id}/cancel").status_code == 404
    assert create(globex, file_id).status_code == 404
    assert globex.get("/v1/batches").json()["data"] == []
    assert Client().get("/v1/batches").status_code == 401
    assert client("sk-mrd-nope").get("/v1/batches").json()["error"]["code"] == "invalid_api_key"


def test_a_file_used_by_a_batch_cannot_be_deleted_but_an_unused_one_can(fleet: Any) -> None:
    c = client(fleet["acme"])
    used = upload(c, jsonl(line("a", "x"))).json()["id"]
    create(c, used)
    refused = c.delete(f"/v1/files/{used}")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "file_in_use"
    unused = upload(c, jsonl(line("a", "x"))).json()["id"]
    deleted = c.delete(f"/v1/files/{unused}")
    assert deleted.json() == {"id": unused, "object": "file", "deleted": True}
    assert c.get(f"/v1/files/{unused}").status_code == 404


BAD_FILES = [
    pytest.param(b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
                 b'"body": {"model": "m"}}\n{not json\n', "line 2: not valid JSON", "file",
                 id="malformed-json"),
    pytest.param(jsonl(line("a", "x"), line("b", "y"), line("a", "z")),
                 'line 3: custom_id "a" repeats line 1', "custom_id", id="repeated-custom-id"),
    pytest.param(jsonl(line("a", "x"), line("b", "y", model="other")),
                 'line 2: model "other" differs from line 1\'s "llama-3.1-8b": one model per batch',
                 "body.model", id="two-models"),
    pytest.param(jsonl(line("a", "x", url="/v1/embeddings")),
                 "line 1: url must be one of /v1/chat/completions, /v1/completions",
                 "url", id="unsupported-url"),
    pytest.param(jsonl({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                        "body": {"prompt": "x"}}),
                 "line 1: body.model must be a non-empty string", "body.model", id="no-model"),
    pytest.param(jsonl(line("a", "x"), [1, 2]), "line 2: a line must be a JSON object", "file",
                 id="not-an-object"),
    pytest.param(b"", "the file has no lines", "file", id="empty"),
]


@pytest.mark.parametrize(("content", "message", "param"), BAD_FILES)
def test_a_bad_file_is_refused_naming_the_line_and_field(fleet: Any, content: bytes,
                                                         message: str, param: str) -> None:
    response = upload(client(fleet["acme"]), content)
    assert response.status_code == 400, response.content
    err = response.json()["error"]
    assert err["message"].startswith(message), err
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert BatchFile.objects.count() == 0


def test_files_over_the_limits_and_wrong_purposes_are_refused(fleet: Any,
                                                            batch_settings: Any) -> None:
    c = client(fleet["acme"])
    batch_settings.BATCH_FILE_MAX_LINES = 2
    too_long = upload(c, jsonl(line("a", "x"), line("b", "x"), line("c", "x")))
    assert too_long.status_code == 400
    assert too_long.json()["error"]["message"] == \
        "the file has more than 2 lines; at most 2 are allowed"
    batch_settings.BATCH_FILE_MAX_BYTES = 100
    too_big = upload(c, jsonl(line("a", "x" * 200)))
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "file_too_large"
    assert "larger than 100 bytes" in too_big.json()["error"]["message"]
    batch_settings.BATCH_FILE_MAX_BYTES = 1024 * 1024
    wrong = upload(c, jsonl(line("a", "x")), purpose="fine-tune")
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "purpose"
    assert BatchFile.objects.count() == 0


def test_bad_batches_are_refused_and_nothing_is_written(fleet: Any) -> None:
    acme, narrow = client(fleet["acme"]), client(fleet["narrow"])
    good = upload(acme, jsonl(line("a", "x"))).json()["id"]
    unknown = upload(acme, jsonl(line("a", "x", model="no-such-model"))).json()["id"]
    us_only = upload(acme, jsonl(line("a", "x", model="us-model"))).json()["id"]
    cases = [
        (create(acme, good, endpoint="/v1/embeddings"), 400, "endpoint",
         "endpoint must be one of"),
        (create(acme, good, endpoint="/v1/completions"), 400, "endpoint",
         "line 1: url /v1/chat/completions does not match the batch's endpoint /v1/completions"),
        (create(acme, unknown), 404, "model", 'model "no-such-model" does not exist'),
        (create(narrow, good), 400, "model", 'this API key may not use model "llama-3.1-8b"'),
        (create(acme, us_only), 400, "model",
         'model "us-model" is not served in the jurisdictions tenant acme may use (EU)'),
        (create(acme, "file-missing"), 404, "input_file_id", "no file file-missing"),
        (create(acme, good, completion_window="1h"), 400, "completion_window",
         'completion_window must be "24h"'),
        (create(acme, good, metadata={"k": 1}), 400, "metadata", 'metadata["k"] must be'),
        (acme.post("/v1/batches", "{oops", content_type="application/json"), 400, None,
         "the request body is not JSON"),
        (acme.post("/v1/batches/batch_nope/cancel"), 404, "id", "No such Batch object"),
    ]
    for response, status, param, message in cases:
        assert response.status_code == status, response.content
        err = response.json()["error"]
        assert err["param"] == param and err["message"].startswith(message), err
    assert Batch.objects.count() == 0 and BatchLine.objects.count() == 0
    assert fleet["sent"] == []


def test_a_batch_past_its_window_expires_with_its_unsent_lines_in_the_error_file(
        fleet: Any) -> None:
    from datetime import timedelta

    from django.utils import timezone

    c = client(fleet["acme"])
    file_id = upload(c, jsonl(line("a", "x"), line("b", "y"))).json()["id"]
    batch_id = create(c, file_id).json()["id"]
    Batch.objects.filter(pk=batch_id).update(expires_at=timezone.now() - timedelta(seconds=1))
    drive(batch_id)
    body = c.get(f"/v1/batches/{batch_id}").json()
    assert body["status"] == "expired" and body["expired_at"] is not None
    assert body["output_file_id"] is None
    errors = output_lines(c, body["error_file_id"])
    assert [(row["custom_id"], row["error"]["code"]) for row in errors] == \
        [("a", "batch_expired"), ("b", "batch_expired")]
    assert fleet["eu"].prompts() == []


def test_the_task_queues_itself_again_until_the_batch_is_finished(fleet: Any,
                                                                  batch_settings: Any) -> None:
    from controlplane.batches.tasks import run_batch

    batch_settings.BATCH_BACKOFF_BASE_S = 30.0   # the retry is due well after this call
    batch_settings.BATCH_BACKOFF_MAX_S = 30.0
    c = client(fleet["acme"])
    batch_id = create(c, upload(c, jsonl(line("a", "busy-1"))).json()["id"]).json()["id"]
    fleet["sent"].clear()
    assert run_batch(batch_id).startswith("again in")
    (name, args, options), = fleet["sent"]
    assert (name, args) == ("batches.run_batch", (batch_id,))
    assert 15.0 <= float(options["countdown"]) <= 30.0     # half fixed, half jitter
    BatchLine.objects.filter(batch_id=batch_id).update(next_attempt_at=None)
    assert run_batch(batch_id) == "finished"
    assert c.get(f"/v1/batches/{batch_id}").json()["status"] == "completed"


def test_the_sweep_queues_again_only_batches_no_worker_has_run_for_a_while(
        fleet: Any) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from controlplane.batches.tasks import sweep

    c = client(fleet["acme"])
    file_id = upload(c, jsonl(line("a", "x"), line("b", "y"))).json()["id"]
    lost, busy, fresh, done = (create(c, file_id).json()["id"] for _ in range(4))
    long_ago = timezone.now() - timedelta(hours=1)
    Batch.objects.filter(pk__in=[lost, busy, done]).update(created_at=long_ago)
    drive(done)
    Batch.objects.filter(pk=busy).update(last_run_at=timezone.now())
    Batch.objects.filter(pk=lost).update(last_run_at=long_ago)
    fleet["sent"].clear()
    assert sweep() == {"requeued": 1}
    assert fleet["sent"] == [("batches.run_batch", (lost,), {})]


def test_with_no_replica_to_send_to_a_batch_waits_without_spending_attempts(fleet: Any) -> None:
    from controlplane.deployments.models import Replica, ReplicaState

    c = client(fleet["acme"])
    batch_id = create(c, upload(c, jsonl(line("a", "x"), line("b", "y"))).json()["id"]).json()["id"]
    eu = Replica.objects.filter(region__jurisdiction__code="EU")
    eu.update(state=ReplicaState.PROVISIONING)   # the US replica stays ready: not acme's to use
    for _ in range(5):
        assert runner.process(batch_id, "w1", budget_s=5.0) == pytest.approx(0.05)
    assert set(BatchLine.objects.filter(batch_id=batch_id).values_list("state", "attempts")) \
        == {(LineState.QUEUED, 0)}
    assert c.get(f"/v1/batches/{batch_id}").json()["status"] == "in_progress"
    eu.update(state=ReplicaState.READY)
    drive(batch_id)
    assert c.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"] == 2
    assert sorted(fleet["eu"].prompts()) == ["x", "y"] and fleet["us"].prompts() == []


def test_a_batch_is_created_even_when_its_task_cannot_be_queued(
        fleet: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from controlplane.batches.tasks import run_batch

    def broker_away(*args: Any, **kwargs: Any) -> None:
        raise ConnectionRefusedError("redis is down")

    monkeypatch.setattr(run_batch, "delay", broker_away)
    c = client(fleet["acme"])
    created = create(c, upload(c, jsonl(line("a", "x"))).json()["id"])
    assert created.status_code == 200, created.content
    assert Batch.objects.filter(pk=created.json()["id"], status="validating").exists()
