"""One generic contract that every REST endpoint is driven through.

A subclass names its URL, who may write, and how to build valid and malformed payloads;
the mixin then checks list / create / retrieve / update / delete, 401 and 403 answers,
field-named 400s that leave stored rows untouched, and a list query count that does not
grow with the number of rows.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from controlplane.core.models import AuditLog, Role

LOWER_ROLE = {Role.ADMIN: Role.OPERATOR, Role.OPERATOR: Role.VIEWER}


@pytest.mark.django_db
class CrudContract:
    url: str = ""
    write_role: Role = Role.ADMIN
    platform_only: bool = True
    read_only: bool = False
    deletable: bool = True

    # -- what each endpoint supplies -------------------------------------------------------
    def existing(self, fx: dict[str, Any]) -> Any:
        raise NotImplementedError

    def create_payload(self, fx: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def update_payload(self, fx: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def bad_payloads(self, fx: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
        raise NotImplementedError

    def make_many(self, fx: dict[str, Any], n: int) -> None:
        raise NotImplementedError

    # -- fixtures ----------------------------------------------------------------------------
    @pytest.fixture
    def fx(self, catalog, tenants):  # type: ignore[no-untyped-def]
        return {**catalog, **tenants}

    def detail(self, obj: Any) -> str:
        return f"{self.url}{obj.pk}/"

    # -- the contract ------------------------------------------------------------------------
    def test_anonymous_gets_401(self, fx, make_client):  # type: ignore[no-untyped-def]
        response = make_client(None).get(self.url)
        assert response.status_code == 401, response.content

    def test_bad_token_gets_401(self, fx, make_client):  # type: ignore[no-untyped-def]
        client = make_client(None)
        client.credentials(HTTP_AUTHORIZATION="Bearer mrd_not-a-real-token")
        assert client.get(self.url).status_code == 401

    def test_viewer_can_list_and_retrieve(self, fx, make_client):  # type: ignore[no-untyped-def]
        obj = self.existing(fx)
        client = make_client(Role.VIEWER)
        listing = client.get(self.url)
        assert listing.status_code == 200, listing.content
        assert listing.json()["count"] >= 1
        detail = client.get(self.detail(obj))
        assert detail.status_code == 200, detail.content
        assert detail.json()["id"] == obj.pk

    def test_unknown_id_gets_404(self, fx, make_client):  # type: ignore[no-untyped-def]
        assert make_client(Role.VIEWER).get(f"{self.url}99999999/").status_code == 404

    def test_writer_can_create_update_delete(self, fx, make_client):  # type: ignore[no-untyped-def]
        client = make_client(self.write_role)
        if self.read_only:
            response = client.post(self.url, {}, format="json")
            assert response.status_code == 405
            return
        before = AuditLog.objects.count()
        created = client.post(self.url, self.create_payload(fx), format="json")
        assert created.status_code == 201, created.content
        url = f"{self.url}{created.json()['id']}/"
        assert client.get(url).status_code == 200
        update = self.update_payload(fx)
        updated = client.patch(url, update, format="json")
        assert updated.status_code == 200, updated.content
        for key, value in update.items():
            if key in updated.json():
                assert updated.json()[key] == value, key
        if self.deletable:
            deleted = client.delete(url)
            assert deleted.status_code == 204, deleted.content
        assert AuditLog.objects.count() >= before + (3 if self.deletable else 2)

    def test_lower_role_cannot_write(self, fx, make_client):  # type: ignore[no-untyped-def]
        if self.read_only:
            return
        obj = self.existing(fx)
        client = make_client(LOWER_ROLE[self.write_role])
        assert client.post(self.url, self.create_payload(fx), format="json").status_code == 403
        assert client.patch(self.detail(obj), self.update_payload(fx), format="json").status_code == 403
        assert client.delete(self.detail(obj)).status_code == 403

    def test_tenant_user_cannot_write_platform_rows(self, fx, make_client):  # type: ignore[no-untyped-def]
        if self.read_only or not self.platform_only:
            return
        client = make_client(Role.ADMIN, fx["acme"])
        response = client.post(self.url, self.create_payload(fx), format="json")
        assert response.status_code == 403, response.content

    def test_malformed_create_names_the_field(self, fx, make_client):  # type: ignore[no-untyped-def]
        if self.read_only:
            return
        client = make_client(self.write_role)
        for payload, field in self.bad_payloads(fx):
            response = client.post(self.url, payload, format="json")
            assert response.status_code == 400, (payload, response.content)
            assert field in response.json(), (field, response.json())

    def test_malformed_update_leaves_row_unchanged(self, fx, make_client):  # type: ignore[no-untyped-def]
        if self.read_only:
            return
        obj = self.existing(fx)
        client = make_client(self.write_role)
        before = client.get(self.detail(obj)).json()
        for payload, field in self.bad_payloads(fx):
            response = client.patch(self.detail(obj), payload, format="json")
            assert response.status_code == 400, (payload, response.content)
            assert field in response.json() or "non_field_errors" in response.json(), field
        assert client.get(self.detail(obj)).json() == before

    def test_invalid_json_is_400(self, fx, make_client):  # type: ignore[no-untyped-def]
        if self.read_only:
            return
        client = make_client(self.write_role)
        response = client.generic("POST", self.url, "{not json", content_type="application/json")
        assert response.status_code == 400
        assert "JSON" in json.dumps(response.json())

    def test_list_query_count_does_not_grow(self, fx, make_client):  # type: ignore[no-untyped-def]
        client = make_client(Role.VIEWER)
        self.make_many(fx, 1)
        client.get(self.url)  # warm caches (content types, sessions)
        with CaptureQueriesContext(connection) as few:
            assert client.get(self.url).status_code == 200
        self.make_many(fx, 15)
        with CaptureQueriesContext(connection) as many:
            assert client.get(self.url).status_code == 200
        assert len(many) == len(few), [q["sql"] for q in many.captured_queries]
