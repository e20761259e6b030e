"""Property-based fuzzing of every operation in /api/schema/: no 500s, no schema mismatches."""

from __future__ import annotations

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


# Every operation of the schema is one subtest of this test: about three minutes on two
# idle cores, so it gets more than the suite's default five minutes of pytest-timeout.
@pytest.mark.timeout(900)
@pytest.mark.django_db(transaction=True)
@schema.parametrize()
@settings(
    max_examples=8, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.filter_too_much],
)
def test_api_never_errors_and_matches_its_schema(case, admin_token):  # type: ignore[no-untyped-def]
    case.call_and_validate(
        headers={"Authorization": f"Bearer {admin_token}"},
        checks=[not_a_server_error, response_schema_conformance],
    )
