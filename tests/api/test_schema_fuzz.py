"""Property-based fuzzing of every operation in /api/schema/: no 500s, no schema mismatches."""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from controlplane.core.models import Role

schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture
def admin_token(catalog, tenants):  # type: ignore[no-untyped-def]
    from controlplane.core.services import ensure_user, issue_api_token

    _, token = issue_api_token(ensure_user("fuzz-admin", Role.ADMIN))
    return token


# Every operation of the schema is one subtest of one of these tests, split by method so that
# pytest-xdist's workers share them out (about three minutes in all on two idle cores); the
# last takes every method the others leave, so no operation goes unfuzzed.
OTHER_METHODS = ("GET", "POST", "PUT", "PATCH")


def fuzz(operations: Any) -> Any:
    @pytest.mark.timeout(900)
    @pytest.mark.django_db(transaction=True)
    @operations.parametrize()
    @settings(
        max_examples=8, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                               HealthCheck.filter_too_much],
    )
    def test(case, admin_token):  # type: ignore[no-untyped-def]
        case.call_and_validate(
            headers={"Authorization": f"Bearer {admin_token}"},
            checks=[not_a_server_error, response_schema_conformance],
        )
    return test


test_reads_never_error_and_match_the_schema = fuzz(schema.include(method="GET"))
test_creates_never_error_and_match_the_schema = fuzz(schema.include(method="POST"))
test_updates_never_error_and_match_the_schema = fuzz(schema.include(method=["PUT", "PATCH"]))
test_other_methods_never_error_and_match_the_schema = fuzz(
    schema.exclude(method=list(OTHER_METHODS)))
