"""Property-based fuzzing of the alerts operations in /api/schema/, with alerts present:
no 500s, responses as the schema says."""

from __future__ import annotations

import pytest
import schemathesis
from django.utils import timezone
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from controlplane.alerts.models import Alert, AlertState, Rule
from controlplane.core.models import Role

schema = schemathesis.pytest.from_fixture("api_schema").include(path_regex=r"^/api/v1/alert")


@pytest.fixture
def operator_token(tenants):  # type: ignore[no-untyped-def]
    from controlplane.core.services import ensure_user, issue_api_token

    now = timezone.now()
    for pk, (rule, state) in enumerate([(Rule.REGION_DOWN, AlertState.OPEN),
                                        (Rule.BUDGET, AlertState.RESOLVED)], start=1):
        Alert.objects.create(
            pk=pk, rule=rule, subject=f"s{pk}", tenant=tenants["acme"], severity="warning",
            state=state, message="m", firing_since=now, opened_at=now, last_evaluated_at=now,
            resolved_at=now if state == AlertState.RESOLVED else None)
    _, token = issue_api_token(ensure_user("fuzz-operator", Role.OPERATOR))
    return token


@pytest.mark.django_db(transaction=True)
@schema.parametrize()
@settings(
    max_examples=25, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.filter_too_much],
)
def test_alert_endpoints_never_error_and_match_their_schema(case, operator_token):  # type: ignore[no-untyped-def]
    case.call_and_validate(
        headers={"Authorization": f"Bearer {operator_token}"},
        checks=[not_a_server_error, response_schema_conformance],
    )
