"""Every REST endpoint driven through the one CRUD contract."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from controlplane.core.models import ApiKey, AuditLog, Role, Tenant
from controlplane.core.services import issue_api_key, record_audit
from controlplane.deployments.models import Deployment, Model, Replica
from regions.models import Cloud, GpuType, Jurisdiction, Offer, Quota, Region
from tests.api.crud_contract import CrudContract

SEEN = datetime(2026, 11, 1, tzinfo=UTC)


class TestClouds(CrudContract):
    url = "/api/v1/clouds/"

    def existing(self, fx):  # type: ignore[no-untyped-def]
        return fx["aws"]

    def create_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"name": "lambda", "display_name": "Lambda", "skypilot_name": "lambda"}

    def update_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"display_name": "Lambda Cloud"}

    def bad_payloads(self, fx):  # type: ignore[no-untyped-def]
        return [({"name": "not a slug!", "display_name": "x"}, "name"),
                ({"name": "ok", "enabled": "perhaps"}, "enabled")]

    def make_many(self, fx, n):  # type: ignore[no-untyped-def]
        for i in range(n):
            Cloud.objects.create(name=f"c{Cloud.objects.count()}-{i}", display_name="x")


class TestJurisdictions(CrudContract):
    url = "/api/v1/jurisdictions/"

    def existing(self, fx):  # type: ignore[no-untyped-def]
        return fx["eu"]

    def create_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"code": "UK", "name": "United Kingdom"}

    def update_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"name": "United Kingdom (UK GDPR)"}

    def bad_payloads(self, fx):  # type: ignore[no-untyped-def]
        return [({"code": "TOOLONGCODE", "name": "x"}, "code"), ({"name": ""}, "name")]

    def make_many(self, fx, n):  # type: ignore[no-untyped-def]
        for i in range(n):
            Jurisdiction.objects.create(code=f"J{Jurisdiction.objects.count()}{i}", name="x")


class TestRegions(CrudContract):
    url = "/api/v1/regions/"

    def existing(self, fx):  # type: ignore[no-untyped-def]
        return fx["fra"]

    def create_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"cloud": "aws", "code": "eu-west-1", "display_name": "Ireland",
                "latitude": 53.3, "longitude": -6.3, "country": "IE", "jurisdiction": "EU"}

    def update_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"display_name": "Europe (Ireland)", "enabled": False}

    def bad_payloads(self, fx):  # type: ignore[no-untyped-def]
        good = self.create_payload(fx)
        return [({**good, "latitude": 123}, "latitude"), ({**good, "cloud": "nope"}, "cloud"),
                ({**good, "jurisdiction": "XX"}, "jurisdiction"), ({**good, "country": "DEU"}, "country")]

    def make_many(self, fx, n):  # type: ignore[no-untyped-def]
        for i in range(n):
            Region.objects.create(cloud=fx["aws"], code=f"r{Region.objects.count()}-{i}",
                                  display_name="x", latitude=1, longitude=1, country="DE",
                                  jurisdiction=fx["eu"])


class TestGpuTypes(CrudContract):
    url = "/api/v1/gpu-types/"

    def existing(self, fx):  # type: ignore[no-untyped-def]
        return fx["h100"]

    def create_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"name": "B200", "memory_gib": 180, "memory_bandwidth_gbps": 8000,
                "bf16_tflops": 2250, "fp16_tflops": 2250}

    def update_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"memory_gib": 192}

    def bad_payloads(self, fx):  # type: ignore[no-untyped-def]
        good = self.create_payload(fx)
        return [({**good, "memory_gib": 0}, "memory_gib"), ({**good, "bf16_tflops": "fast"}, "bf16_tflops")]

    def make_many(self, fx, n):  # type: ignore[no-untyped-def]
        for i in range(n):
            GpuType.objects.create(name=f"G{GpuType.objects.count()}-{i}", memory_gib=1,
                                   memory_bandwidth_gbps=1, bf16_tflops=1, fp16_tflops=1)


class TestOffers(CrudContract):
    url = "/api/v1/offers/"

    def existing(self, fx):  # type: ignore[no-untyped-def]
        return Offer.objects.filter(region=fx["fra"]).first()

    def create_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"region": "aws:eu-central-1", "gpu_type": "H100", "gpus_per_node": 8,
                "instance_type": "p5.48xlarge", "on_demand_usd_h": "98.3200", "spot_usd_h": "40.0000"}

    def update_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"on_demand_usd_h": "90.0000"}

    def bad_payloads(self, fx):  # type: ignore[no-untyped-def]
        good = self.create_payload(fx)
        return [({**good, "spot_usd_h": "120.0000"}, "spot_usd_h"),
                ({**good, "on_demand_usd_h": "-1"}, "on_demand_usd_h"),
                ({**good, "region": "aws-eu"}, "region"), ({**good, "gpus_per_node": 0}, "gpus_per_node")]

    def make_many(self, fx, n):  # type: ignore[no-untyped-def]
        for i in range(n):
            Offer.objects.create(region=fx["ams"], gpu_type=fx["h100"], gpus_per_node=8,
                                 instance_type=f"x{Offer.objects.count()}-{i}",
                                 on_demand_usd_h=Decimal("1"), observed_at=SEEN)


class TestQuotas(CrudContract):
    url = "/api/v1/quotas/"

    def existing(self, fx):  # type: ignore[no-untyped-def]
        return Quota.objects.filter(region=fx["fra"]).first()

    def create_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"region": "aws:eu-central-1", "gpu_type": "L4", "limit_gpus": 32}

    def update_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"limit_gpus": 64, "in_use_gpus": 8}

    def bad_payloads(self, fx):  # type: ignore[no-untyped-def]
        good = self.create_payload(fx)
        return [({**good, "limit_gpus": -4}, "limit_gpus"), ({**good, "gpu_type": "Z9"}, "gpu_type")]

    def make_many(self, fx, n):  # type: ignore[no-untyped-def]
        for i in range(n):
            gpu = GpuType.objects.create(name=f"Q{GpuType.objects.count()}-{i}", memory_gib=1,
                                         memory_bandwidth_gbps=1, bf16_tflops=1, fp16_tflops=1)
            Quota.objects.create(region=fx["fra"], gpu_type=gpu, limit_gpus=1, observed_at=SEEN)


class TestModels(CrudContract):
    url = "/api/v1/models/"

    def existing(self, fx):  # type: ignore[no-untyped-def]
        return fx["llama8b"]

    def create_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"name": "llama-3.1-70b-instruct", "hf_id": "meta-llama/Llama-3.1-70B-Instruct",
                "parameters_b": 70.6, "layers": 80, "attention_heads": 64, "kv_heads": 8,
                "head_dim": 128, "max_context": 131072}

    def update_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"family": "llama"}

    def bad_payloads(self, fx):  # type: ignore[no-untyped-def]
        good = self.create_payload(fx)
        return [({**good, "kv_heads": 7}, "kv_heads"), ({**good, "layers": 0}, "layers"),
                ({**good, "dtype": "float128"}, "dtype")]

    def make_many(self, fx, n):  # type: ignore[no-untyped-def]
        for i in range(n):
            Model.objects.create(name=f"m{Model.objects.count()}-{i}", hf_id="x", parameters_b=1,
                                 layers=1, attention_heads=1, kv_heads=1, head_dim=1, max_context=1)


class TestTenants(CrudContract):
    url = "/api/v1/tenants/"

    def existing(self, fx):  # type: ignore[no-untyped-def]
        return fx["acme"]

    def create_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"name": "initech", "allowed_jurisdictions": ["US"], "rpm_limit": 60}

    def update_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"tpm_limit": 50000, "allowed_jurisdictions": ["EU", "US"]}

    def bad_payloads(self, fx):  # type: ignore[no-untyped-def]
        return [({"name": "x", "rpm_limit": 0}, "rpm_limit"),
                ({"name": "x", "allowed_jurisdictions": ["MARS"]}, "allowed_jurisdictions"),
                ({"name": "x", "allowed_jurisdictions": ["US"], "allowed_regions": ["aws:eu-central-1"]},
                 "allowed_regions")]

    def make_many(self, fx, n):  # type: ignore[no-untyped-def]
        for i in range(n):
            tenant = Tenant.objects.create(name=f"t{Tenant.objects.count()}-{i}")
            tenant.allowed_jurisdictions.set([fx["eu"]])
            tenant.allowed_regions.set([fx["fra"]])


class TestApiKeys(CrudContract):
    url = "/api/v1/api-keys/"
    platform_only = False

    def existing(self, fx):  # type: ignore[no-untyped-def]
        row, _ = issue_api_key(fx["acme"], "existing", "interactive")
        return row

    def create_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"tenant": "acme", "name": "web", "tier": "batch", "allowed_models": ["*"]}

    def update_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"name": "web-frontend"}

    def bad_payloads(self, fx):  # type: ignore[no-untyped-def]
        return [({"tenant": "acme", "name": "x", "tier": "premium"}, "tier"),
                ({"tenant": "nobody", "name": "x"}, "tenant"),
                ({"tenant": "acme", "name": "x", "allowed_models": "all"}, "allowed_models")]

    def make_many(self, fx, n):  # type: ignore[no-untyped-def]
        for i in range(n):
            issue_api_key(fx["acme"], f"k{ApiKey.objects.count()}-{i}", "interactive")


class TestDeployments(CrudContract):
    url = "/api/v1/deployments/"
    write_role = Role.OPERATOR
    platform_only = False

    def existing(self, fx):  # type: ignore[no-untyped-def]
        return make_deployment(fx, "chat-eu")

    def create_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"name": "chat-us", "served_model_name": "llama-3.1-8b", "model": "llama-3.1-8b-instruct",
                "tenant": "globex", "allowed_jurisdictions": ["US"], "user_regions": ["aws:us-east-1"],
                "min_replicas": 1, "max_replicas": 3, "max_model_len": 8192}

    def update_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"max_replicas": 6, "max_spot_fraction": 0.5}

    def bad_payloads(self, fx):  # type: ignore[no-untyped-def]
        good = self.create_payload(fx)
        return [({**good, "min_replicas": 5, "max_replicas": 2}, "min_replicas"),
                ({**good, "tensor_parallel": 3}, "tensor_parallel"),
                ({**good, "max_model_len": 1_000_000}, "max_model_len"),
                ({**good, "allowed_jurisdictions": ["ZZ"]}, "allowed_jurisdictions"),
                ({**good, "tenant": "acme", "allowed_jurisdictions": ["US"]}, "allowed_jurisdictions"),
                ({**good, "max_spot_fraction": 1.5}, "max_spot_fraction"),
                ({**good, "warm_pool": 3}, "warm_pool"),
                ({**good, "target_inflight_per_replica": 0}, "target_inflight_per_replica")]

    def make_many(self, fx, n):  # type: ignore[no-untyped-def]
        for i in range(n):
            make_deployment(fx, f"d{Deployment.objects.count()}-{i}")


class TestReplicas(CrudContract):
    url = "/api/v1/replicas/"
    read_only = True

    def existing(self, fx):  # type: ignore[no-untyped-def]
        return Replica.objects.create(deployment=make_deployment(fx, "rep"), region=fx["fra"])

    def make_many(self, fx, n):  # type: ignore[no-untyped-def]
        deployment = make_deployment(fx, f"rep{Deployment.objects.count()}")
        for _ in range(n):
            Replica.objects.create(deployment=deployment, region=fx["fra"])


class TestAuditLog(CrudContract):
    url = "/api/v1/audit-log/"
    read_only = True

    def existing(self, fx):  # type: ignore[no-untyped-def]
        return record_audit("tester", "create", fx["aws"])

    def make_many(self, fx, n):  # type: ignore[no-untyped-def]
        for _ in range(n):
            record_audit("tester", "update", fx["aws"])


def make_deployment(fx: dict[str, Any], name: str, tenant: Tenant | None = None) -> Deployment:
    deployment = Deployment.objects.create(
        name=name, served_model_name="llama-3.1-8b", model=fx["llama8b"],
        tenant=tenant if tenant is not None else fx["acme"],
    )
    deployment.allowed_jurisdictions.set([fx["eu"]])
    deployment.user_regions.set([fx["fra"]])
    return deployment


def test_audit_rows_refuse_update_and_delete(db, catalog):  # type: ignore[no-untyped-def]
    import pytest
    from django.db import DatabaseError, transaction

    row = record_audit("tester", "create", catalog["aws"])
    with pytest.raises(DatabaseError), transaction.atomic():
        AuditLog.objects.filter(pk=row.pk).update(actor="someone else")
    with pytest.raises(DatabaseError), transaction.atomic():
        AuditLog.objects.filter(pk=row.pk).delete()
    assert AuditLog.objects.get(pk=row.pk).actor == "tester"


class TestEdges(CrudContract):
    url = "/api/v1/edges/"

    def existing(self, fx):  # type: ignore[no-untyped-def]
        from controlplane.routing.models import Edge

        return Edge.objects.create(name="edge-fra", region=fx["fra"], admin_url="http://127.0.0.1:1")

    def create_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"name": "edge-iad", "region": "aws:us-east-1", "admin_url": "http://127.0.0.1:9"}

    def update_payload(self, fx):  # type: ignore[no-untyped-def]
        return {"enabled": False}

    def bad_payloads(self, fx):  # type: ignore[no-untyped-def]
        good = self.create_payload(fx)
        return [({**good, "admin_url": "not a url"}, "admin_url"),
                ({**good, "region": "aws:nowhere-9"}, "region"), ({**good, "name": "bad name"}, "name")]

    def make_many(self, fx, n):  # type: ignore[no-untyped-def]
        from controlplane.routing.models import Edge

        for i in range(n):
            Edge.objects.create(name=f"e{Edge.objects.count()}-{i}", region=fx["fra"],
                                admin_url="http://127.0.0.1:1")


class TestOperations(CrudContract):
    url = "/api/v1/operations/"
    read_only = True

    def existing(self, fx):  # type: ignore[no-untyped-def]
        from controlplane.provisioning.models import Operation

        replica = Replica.objects.create(deployment=make_deployment(fx, "ops"), region=fx["fra"])
        return Operation.objects.create(kind="launch", provider="local", replica=replica)

    def make_many(self, fx, n):  # type: ignore[no-untyped-def]
        from controlplane.provisioning.models import Operation

        replica = Replica.objects.create(
            deployment=make_deployment(fx, f"ops{Deployment.objects.count()}"), region=fx["fra"])
        for _ in range(n):
            Operation.objects.create(kind="launch", provider="local", replica=replica)
