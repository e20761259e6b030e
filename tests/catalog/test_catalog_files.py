"""Integrity of the shipped data files: the GPU catalog and the open-model catalog.

Plain JSON checks, no database: every name resolves, keys are unique, figures are in range.
Run with `python -m pytest -p no:django tests/catalog`.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from datetime import date
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CATALOG = ROOT / "regions" / "catalog" / "catalog.json"
MODELS = ROOT / "controlplane" / "deployments" / "catalog" / "models.json"

EU_MEMBERS = {
    "AT", "BE", "BG", "HR", "CY", "CZ", "DK", "EE", "FI", "FR", "DE", "GR", "HU", "IE", "IT",
    "LV", "LT", "LU", "MT", "NL", "PL", "PT", "RO", "SK", "SI", "ES", "SE",
}
# Families whose configs set head_dim independently of hidden_size / attention_heads.
DECOUPLED_HEAD_DIM = ("gemma-", "qwen3-", "mistral-small-")
MODEL_DTYPES = {"bfloat16", "float16", "fp8", "int8", "int4"}


@pytest.fixture(scope="module")
def catalog() -> dict[str, Any]:
    return json.loads(CATALOG.read_text())


@pytest.fixture(scope="module")
def models() -> list[dict[str, Any]]:
    return json.loads(MODELS.read_text())


def _dupes(keys: list[Any]) -> list[Any]:
    return [key for key, n in Counter(keys).items() if n > 1]


# ------------------------------------------------------------------ GPU catalog


def test_top_level_shape(catalog: dict[str, Any]) -> None:
    for key in ("as_of", "sources", "jurisdictions", "clouds", "regions", "gpu_types",
                "offers", "quotas"):
        assert key in catalog, key
        if key != "as_of":
            assert isinstance(catalog[key], list) and catalog[key], key
    assert date.fromisoformat(catalog["as_of"]) <= date.today()


def test_minimum_sizes(catalog: dict[str, Any]) -> None:
    assert len(catalog["clouds"]) >= 5
    assert len(catalog["regions"]) >= 40
    assert len(catalog["gpu_types"]) >= 8
    assert len(catalog["offers"]) >= 300


def test_every_cloud_has_a_source(catalog: dict[str, Any]) -> None:
    clouds = {c["name"] for c in catalog["clouds"]}
    cited = {s["cloud"] for s in catalog["sources"] if s.get("url", "").startswith("https://")}
    assert clouds <= cited, clouds - cited
    for source in catalog["sources"]:
        assert source["cloud"] in clouds | {"*"}, source
        assert source["what"].strip(), source


def test_clouds_and_jurisdictions_unique(catalog: dict[str, Any]) -> None:
    assert not _dupes([c["name"] for c in catalog["clouds"]])
    assert not _dupes([c["skypilot_name"] for c in catalog["clouds"]])
    for cloud in catalog["clouds"]:
        assert cloud["display_name"] and cloud["skypilot_name"], cloud
    assert not _dupes([j["code"] for j in catalog["jurisdictions"]])
    for jurisdiction in catalog["jurisdictions"]:
        assert jurisdiction["name"], jurisdiction


def test_regions_resolve_and_are_in_range(catalog: dict[str, Any]) -> None:
    clouds = {c["name"] for c in catalog["clouds"]}
    jurisdictions = {j["code"] for j in catalog["jurisdictions"]}
    keys = [(r["cloud"], r["code"]) for r in catalog["regions"]]
    assert not _dupes(keys)
    for region in catalog["regions"]:
        where = f"{region['cloud']}:{region['code']}"
        assert region["cloud"] in clouds, where
        assert region["display_name"], where
        assert -90 <= region["latitude"] <= 90, where
        assert -180 <= region["longitude"] <= 180, where
        assert (region["latitude"], region["longitude"]) != (0, 0), where
        assert re.fullmatch(r"[A-Z]{2}", region["country"]), where
        assert region["jurisdiction"] in jurisdictions, where


def test_jurisdiction_follows_country(catalog: dict[str, Any]) -> None:
    for region in catalog["regions"]:
        country = region["country"]
        expected = "EU" if country in EU_MEMBERS else "UK" if country == "GB" else country
        assert region["jurisdiction"] == expected, (region["cloud"], region["code"])


def test_regions_cover_every_inhabited_continent(catalog: dict[str, Any]) -> None:
    def where(lat: float, lon: float) -> str:
        if lon < -30:
            return "south-america" if lat < 12 else "north-america"
        if lat < -10 and lon > 110:
            return "oceania"
        if lon < 45 and lat > 35:
            return "europe"
        return "asia"

    seen = {where(r["latitude"], r["longitude"]) for r in catalog["regions"]}
    assert {"north-america", "south-america", "europe", "asia", "oceania"} <= seen


def test_gpu_types(catalog: dict[str, Any]) -> None:
    assert not _dupes([g["name"] for g in catalog["gpu_types"]])
    for gpu in catalog["gpu_types"]:
        assert gpu["vendor"] in {"nvidia", "amd"}, gpu
        assert 16 <= gpu["memory_gib"] <= 288, gpu
        assert 100 <= gpu["memory_bandwidth_gbps"] <= 10_000, gpu
        assert 10 <= gpu["bf16_tflops"] <= 5_000, gpu
        assert gpu["fp16_tflops"] > 0, gpu
        assert gpu["skypilot_name"], gpu
    by_name = {g["name"]: g for g in catalog["gpu_types"]}
    if {"A100", "A100-80GB"} <= by_name.keys():
        assert by_name["A100"]["memory_gib"] < by_name["A100-80GB"]["memory_gib"]
    if {"H100", "H200"} <= by_name.keys():
        assert by_name["H100"]["memory_bandwidth_gbps"] < by_name["H200"]["memory_bandwidth_gbps"]


def test_offers_resolve(catalog: dict[str, Any]) -> None:
    regions = {(r["cloud"], r["code"]) for r in catalog["regions"]}
    gpus = {g["name"] for g in catalog["gpu_types"]}
    for offer in catalog["offers"]:
        assert (offer["cloud"], offer["region"]) in regions, offer
        assert offer["gpu"] in gpus, offer
        assert isinstance(offer["gpus_per_node"], int) and 1 <= offer["gpus_per_node"] <= 16
        assert offer["instance_type"], offer
    shapes = [(o["cloud"], o["region"], o["gpu"], o["gpus_per_node"], o["instance_type"])
              for o in catalog["offers"]]
    assert not _dupes(shapes)


def test_offer_prices(catalog: dict[str, Any]) -> None:
    for offer in catalog["offers"]:
        on_demand, spot = offer["on_demand_usd_h"], offer["spot_usd_h"]
        assert on_demand > 0, offer
        per_gpu = on_demand / offer["gpus_per_node"]
        assert 0.1 <= per_gpu <= 25, offer
        if spot is not None:
            assert 0 < spot < on_demand, offer
    assert all(o["spot_usd_h"] is None for o in catalog["offers"] if o["cloud"] == "lambda")


def test_one_instance_type_means_one_shape(catalog: dict[str, Any]) -> None:
    shapes = defaultdict(set)
    for offer in catalog["offers"]:
        shapes[(offer["cloud"], offer["instance_type"])].add(
            (offer["gpu"], offer["gpus_per_node"]))
    assert not {key: s for key, s in shapes.items() if len(s) > 1}


def test_big_clouds_price_by_region(catalog: dict[str, Any]) -> None:
    prices = defaultdict(set)
    for offer in catalog["offers"]:
        prices[(offer["cloud"], offer["instance_type"])].add(offer["on_demand_usd_h"])
    for cloud in ("aws", "gcp", "azure"):
        varied = [k for k, p in prices.items() if k[0] == cloud and len(p) > 1]
        assert varied, f"{cloud}: every instance type has one price everywhere"


def test_single_gpu_sizes_are_offered(catalog: dict[str, Any]) -> None:
    singles = {(o["cloud"], o["gpu"]) for o in catalog["offers"] if o["gpus_per_node"] == 1}
    for pair in (("aws", "L4"), ("aws", "A10G"), ("gcp", "A100"), ("gcp", "H100"),
                 ("lambda", "H100")):
        if any((o["cloud"], o["gpu"]) == pair for o in catalog["offers"]):
            assert pair in singles, pair


def test_every_offer_has_quota(catalog: dict[str, Any]) -> None:
    quota_keys = [(q["cloud"], q["region"], q["gpu"]) for q in catalog["quotas"]]
    assert not _dupes(quota_keys)
    quotas = {(q["cloud"], q["region"], q["gpu"]): q["limit_gpus"] for q in catalog["quotas"]}
    largest: dict[tuple[str, str, str], int] = defaultdict(int)
    for offer in catalog["offers"]:
        key = (offer["cloud"], offer["region"], offer["gpu"])
        largest[key] = max(largest[key], offer["gpus_per_node"])
    missing = set(largest) - set(quotas)
    assert not missing, sorted(missing)
    orphans = set(quotas) - set(largest)
    assert not orphans, sorted(orphans)
    for key, limit in quotas.items():
        assert isinstance(limit, int) and limit >= largest[key], key


# ------------------------------------------------------------------ model catalog


def test_model_catalog_shape(models: list[dict[str, Any]]) -> None:
    assert isinstance(models, list) and len(models) >= 15
    assert not _dupes([m["name"] for m in models])
    assert not _dupes([m["hf_id"] for m in models])
    for model in models:
        for field in ("name", "hf_id", "family", "parameters_b", "layers", "hidden_size",
                      "attention_heads", "kv_heads", "head_dim", "dtype", "max_context",
                      "license"):
            assert model.get(field) not in (None, ""), (model.get("name"), field)
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", model["name"]), model["name"]
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", model["hf_id"]), model["hf_id"]
        assert model["dtype"] in MODEL_DTYPES, model["name"]


@pytest.mark.parametrize("field", ["layers", "hidden_size", "attention_heads", "kv_heads",
                                   "head_dim", "max_context"])
def test_model_integers_positive(models: list[dict[str, Any]], field: str) -> None:
    for model in models:
        assert isinstance(model[field], int) and model[field] > 0, (model["name"], field)


def test_model_sizes(models: list[dict[str, Any]]) -> None:
    for model in models:
        assert 0.1 <= model["parameters_b"] <= 2_000, model["name"]
        assert model["max_context"] >= 4096, model["name"]
        active = model.get("active_parameters_b")
        if active is not None:
            assert 0 < active < model["parameters_b"], model["name"]


def test_kv_heads_divide_attention_heads(models: list[dict[str, Any]]) -> None:
    for model in models:
        assert model["kv_heads"] <= model["attention_heads"], model["name"]
        assert model["attention_heads"] % model["kv_heads"] == 0, model["name"]


def test_head_dim_matches_hidden_size(models: list[dict[str, Any]]) -> None:
    checked = 0
    for model in models:
        if model["name"].startswith(DECOUPLED_HEAD_DIM):
            continue
        assert model["head_dim"] * model["attention_heads"] == model["hidden_size"], model["name"]
        checked += 1
    assert checked >= 10


def test_head_dims_are_usual_sizes(models: list[dict[str, Any]]) -> None:
    for model in models:
        assert model["head_dim"] in {64, 80, 96, 128, 256}, model["name"]
