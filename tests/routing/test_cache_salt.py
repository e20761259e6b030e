"""Each tenant's prefix-cache salt in the tables: one per tenant, secret to the control
plane's key, valid by the edge's rules; and which replicas let tenants share their cache."""

from __future__ import annotations

import pytest

from controlplane.core.services import issue_api_key
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.routing import cache_salt, services, signing
from controlplane.routing.models import Edge
from edge.cache_salt import valid_tenant_salt
from edge.table import parse_table
from tests.api.test_endpoints_crud import make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet(catalog, tenants, signing_key_file):  # type: ignore[no-untyped-def]
    fx = {**catalog, **tenants}
    shared = make_deployment(fx, "chat-shared")
    shared.tenant = None
    shared.save()
    pooled = make_deployment(fx, "chat-pooled")
    pooled.tenant, pooled.served_model_name, pooled.shared_prefix_cache = None, "pooled", True
    pooled.save()
    owned = make_deployment(fx, "chat-acme")
    owned.served_model_name = "acme-only"
    owned.save()
    for i, deployment in enumerate((shared, pooled, owned)):
        Replica.objects.create(deployment=deployment, region=catalog["fra"], state=S.READY,
                               url=f"http://127.0.0.1:{9101 + i}")
    for tenant, name in ((tenants["acme"], "web"), (tenants["acme"], "batch"),
                         (tenants["globex"], "web")):
        issue_api_key(tenant, name, "interactive")
    Edge.objects.create(name="edge-eu", region=catalog["fra"], admin_url="http://127.0.0.1:9")
    return fx


def newest_table():  # type: ignore[no-untyped-def]
    (table,) = services.compile_tables(force=True)
    return table.payload


def test_every_tenant_has_one_salt_of_its_own_in_the_table(fleet) -> None:  # type: ignore[no-untyped-def]
    table = newest_table()
    salts: dict[str, set[str]] = {}
    for entry in table["tenants"].values():
        salts.setdefault(entry["tenant"], set()).add(entry["cache_salt"])
    assert salts.keys() == {"acme", "globex"}
    (acme,), (globex,) = salts["acme"], salts["globex"]  # both of acme's keys: one salt
    assert acme != globex and valid_tenant_salt(acme) and len(acme) == 43
    assert acme == cache_salt.tenant_cache_salt(fleet["acme"].pk)
    parsed = parse_table(table)  # the edge takes it as it is
    assert {r.cache_salt for r in parsed.tenants.values()} == {acme, globex}
    # A rename keeps the salt (and the engines' cache); the same key gives the same salts.
    fleet["acme"].display_name = "Acme AG"
    fleet["acme"].save()
    assert {e["cache_salt"] for e in newest_table()["tenants"].values()} == {acme, globex}


def test_salts_come_from_the_control_planes_key_and_change_with_it(  # type: ignore[no-untyped-def]
        fleet, tmp_path, monkeypatch) -> None:
    before = {e["cache_salt"] for e in newest_table()["tenants"].values()}
    private, _ = signing.generate_key_files(tmp_path / "other-key.pem")
    monkeypatch.setenv("MERIDIAN_SIGNING_KEY_FILE", str(private))
    signing.signing_key.cache_clear()
    after = {e["cache_salt"] for e in newest_table()["tenants"].values()}
    assert len(after) == 2 and not before & after


def test_only_shared_deployments_that_opted_in_share_their_cache(fleet) -> None:  # type: ignore[no-untyped-def]
    models = newest_table()["models"]
    flags = {name: [r.get("shared_prefix_cache", False) for r in entry["replicas"]]
             for name, entry in models.items()}
    assert flags == {"llama-3.1-8b": [False], "pooled": [True], "acme-only": [False]}
    assert models["acme-only"]["replicas"][0]["tenant"] == "acme"
