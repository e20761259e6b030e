"""Planning the whole fleet at once vs placing each deployment on its own.

Synthetic fleets of up to 1,000 deployments over the shipped catalog (every cloud, region
and offer): Meridian's MILP against a per-deployment, cheapest-first greedy baseline that
follows the same rules (residency, latency, spread, spot fraction, quota). Reports solve
time, the gap to the LP relaxation's bound, and Meridian's $/h over greedy's.

    python bench/placement_scale.py [--quick | --smoke] [--sizes 10,100,1000] [--seed 7]

(`--smoke`: 10 deployments, to check that every step runs, not the figures)

Progress on stderr; one JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from controlplane.placement.capacity import (  # noqa: E402
    DEFAULT_BATCH,
    GpuSpec,
    ModelSpec,
    parallel_layout,
)
from controlplane.placement.greedy import place_greedy  # noqa: E402
from controlplane.placement.problem import (  # noqa: E402
    DeploymentRequest,
    OfferOption,
    PlacementProblem,
)
from controlplane.placement.search import solve  # noqa: E402

CATALOG = REPO / "regions" / "catalog" / "catalog.json"
MODELS = REPO / "controlplane" / "deployments" / "catalog" / "models.json"
FLEET_MODELS = ("llama-3.1-8b-instruct", "qwen2.5-7b-instruct", "mistral-7b-instruct-v0.3",
                "qwen2.5-14b-instruct", "qwen2.5-32b-instruct", "llama-3.1-70b-instruct")
JURISDICTION_SETS = (("EU",), ("US",), ("EU", "UK", "CH"), ("US", "CA"), ("JP",), ("IN",),
                     ("EU", "US", "UK"), ("SG", "AU"), ("UK",))


# What every run's JSON line holds (tests/bench/test_benchmarks.py checks it at --smoke).
RESULT_KEYS = ("benchmark", "quick", "smoke", "deployments", "offers", "variables", "status",
               "solve_s", "gap_to_lp_bound", "usd_h", "greedy_usd_h", "cost_ratio_vs_greedy",
               "rounds", "targets")


def log(message: str) -> None:
    print(f"[placement_scale] {message}", file=sys.stderr, flush=True)


def load_catalog() -> tuple[tuple[OfferOption, ...], dict[tuple[str, str], int], dict, dict]:
    data = json.loads(CATALOG.read_text())
    gpus = {g["name"]: GpuSpec(g["name"], g["memory_gib"], g["memory_bandwidth_gbps"])
            for g in data["gpu_types"]}
    regions = {(r["cloud"], r["code"]): r for r in data["regions"]}
    offers = []
    for i, o in enumerate(data["offers"]):
        r = regions[(o["cloud"], o["region"])]
        offers.append(OfferOption(i, f"{o['cloud']}:{o['region']}", o["cloud"], r["jurisdiction"],
                                  gpus[o["gpu"]], o["gpus_per_node"], o["on_demand_usd_h"],
                                  o["spot_usd_h"], r["latitude"], r["longitude"]))
    quota = {(f"{q['cloud']}:{q['region']}", q["gpu"]): q["limit_gpus"] for q in data["quotas"]}
    models = {m["name"]: ModelSpec(m["name"], m["parameters_b"], m["layers"],
                                   m["attention_heads"], m["kv_heads"], m["head_dim"])
              for m in json.loads(MODELS.read_text())}
    return tuple(offers), quota, models, regions


# Each deployment's engine layout is set the way an operator would: the smallest TP (then
# PP) that holds its model at its context on 8×H100 nodes. Offers whose nodes cannot run that
# engine are no options for it.
REFERENCE_GPU = GpuSpec("H100", 80, 3350)


def layout_for(model: ModelSpec, context: int) -> tuple[int, int]:
    layout = parallel_layout(model, REFERENCE_GPU, 8, DEFAULT_BATCH, context)
    assert layout is not None, (model.name, context)
    return layout


def fleet(n: int, rng: random.Random, models: dict, regions: dict) -> tuple[DeploymentRequest, ...]:
    by_jurisdiction: dict[str, list[dict]] = {}
    for r in regions.values():
        by_jurisdiction.setdefault(r["jurisdiction"], []).append(r)
    out = []
    for i in range(n):
        jurisdictions = rng.choice(JURISDICTION_SETS)
        home = rng.choice(by_jurisdiction[jurisdictions[0]])
        low = rng.choice((1, 1, 2, 2, 3))
        model = models[rng.choice(FLEET_MODELS)]
        context = rng.choice((4096, 8192, 16384))
        tp, pp = layout_for(model, context)
        out.append(DeploymentRequest(
            id=i, name=f"fleet-{i}", model=model, context=context,
            tensor_parallel=tp, pipeline_parallel=pp,
            tokens_per_s=float(rng.choice((0, 300, 1000, 2500, 4000))),
            min_replicas=low, max_replicas=low + rng.choice((4, 8, 12)),
            allowed_jurisdictions=frozenset(jurisdictions),
            spread_regions=rng.choice((1, 1, 2)), max_spot_fraction=rng.choice((0.0, 0.0, 0.3, 0.5)),
            ttft_slo_ms=float(rng.choice((300, 800, 2000))),
            user_locations=((home["latitude"], home["longitude"]),),
        ))
    return tuple(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="10 deployments: every step, not the figures")
    parser.add_argument("--sizes", default=None)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    default_sizes = "10" if args.smoke else "100,1000" if args.quick else "10,100,300,1000"
    sizes = [int(s) for s in (args.sizes or default_sizes).split(",")]
    offers, quota, models, regions = load_catalog()
    # Quota is shared by the whole fleet: scale it so the large fleet contends for it.
    rounds = []
    for n in sizes:
        rng = random.Random(args.seed + n)
        deployments = fleet(n, rng, models, regions)
        scaled = {k: max(8, v * max(n, 100) // 100) for k, v in quota.items()}
        problem = PlacementProblem(deployments, offers, scaled, time_limit_s=60, mip_rel_gap=0.005)
        started = time.perf_counter()
        result = solve(problem)
        wall = time.perf_counter() - started
        greedy = place_greedy(problem)
        # When greedy strands deployments (quota taken by those placed before them), the
        # costs are compared over the deployments it did place; Meridian's plan also serves
        # the rest, so this ratio is if anything unfavourable to Meridian.
        placed = {a.deployment_id for a in greedy.assignments}
        ours = sum(a.usd_h for a in result.assignments if a.deployment_id in placed)
        ratio = (ours / greedy.cost_after_usd_h
                 if greedy.cost_after_usd_h and result.status != "infeasible" else None)
        stranded = len({d.id for d in deployments if d.must_run} - placed)
        row = {
            "deployments": n, "offers": len(offers), "variables": result.variables,
            "status": result.status, "solve_s": round(wall, 3),
            "gap_to_lp_bound": None if result.gap_to_lp_bound is None else round(result.gap_to_lp_bound, 5),
            "usd_h": round(result.cost_after_usd_h, 2),
            "greedy_usd_h": round(greedy.cost_after_usd_h, 2), "greedy_status": greedy.status,
            "greedy_unplaced": stranded,
            "cost_ratio_vs_greedy": None if ratio is None else round(ratio, 4),
        }
        rounds.append(row)
        log(f"{n:5d} deployments: {result.status} in {wall:.2f} s, {result.variables} variables, "
            f"${result.cost_after_usd_h:,.0f}/h vs greedy ${greedy.cost_after_usd_h:,.0f}/h "
            f"({greedy.status}, {stranded} left unplaced); gap to LP bound {row['gap_to_lp_bound']}")
        if result.status == "infeasible":
            log("  " + "; ".join(result.explanation[:3]))
    largest = rounds[-1]
    print(json.dumps({"benchmark": "placement_scale", "quick": args.quick,
                      "smoke": args.smoke, **largest,
                      "rounds": rounds, "targets": {"solve_s": 10, "gap_to_lp_bound": 0.01,
                                                    "cost_ratio_vs_greedy_max": 1.0}}))


if __name__ == "__main__":
    main()
