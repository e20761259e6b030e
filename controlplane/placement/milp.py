"""The mixed-integer program of a set of deployments and the HiGHS run that solves it.

Variables, per deployment d: x[d, o, s] — integer replicas on offer o, on demand (s=0) or
spot (s=1); y[d, r] and z[d, c] — binary, d uses region r / cloud c (only where spread is
asked for); u[d, o, s] — replicas that run today and the plan removes.
Objective: Σ $/h × x + move penalty × Σ u.
Constraints: Σ tokens/s × x ≥ demand × headroom; min ≤ Σ x ≤ max; Σ spot x ≤ fraction × Σ x;
Σ_r y ≥ k with y[r] ≤ Σ x in r (clouds alike); u ≥ running − x; and, shared by the fleet,
Σ GPUs × x ≤ quota per (region, GPU type).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import highspy
import numpy as np
from scipy.sparse import csc_matrix

from controlplane.placement.candidates import Candidate
from controlplane.placement.problem import DeploymentRequest, Pool

ELASTIC_USD_PER_GPU = 1e5


@dataclass
class Block:
    """One deployment's part of a model: its options and what runs today."""

    d: DeploymentRequest
    cands: list[Candidate]
    running: dict[tuple[int, bool], int]  # (offer id, spot) → replicas running on an option
    floor: float = 0.0  # a lower bound on the block's objective, known from solving it alone
    first_col: int = 0
    start: dict[int, int] | None = None  # candidate index → replicas: a plan to start from


@dataclass
class Milp:
    blocks: list[Block]
    cost: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    integer: np.ndarray
    matrix: csc_matrix
    row_lower: np.ndarray
    row_upper: np.ndarray
    removal_cols: list[tuple[int, int]]  # (column, block index)
    shortfall_cols: list[tuple[int, Pool]] = field(default_factory=list)
    start: np.ndarray | None = None  # a feasible point, when every block brings its plan

    @property
    def columns(self) -> int:
        return len(self.cost)


class Rows:
    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []

    def add(self, entries: Iterable[tuple[int, float]], lo: float, hi: float) -> None:
        r = len(self.lower)
        for col, val in entries:
            self.rows.append(r)
            self.cols.append(col)
            self.vals.append(val)
        self.lower.append(lo)
        self.upper.append(hi)


class Columns:
    """The model's variables: cost, bounds, integrality and a starting value each."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[bool] = []
        self.start: list[float] = []

    def add(self, c: float, lo: float, hi: float, is_int: bool, value: float = 0.0) -> int:
        self.cost.append(c)
        self.lower.append(lo)
        self.upper.append(hi)
        self.integer.append(is_int)
        self.start.append(value)
        return len(self.cost) - 1


def build(blocks: list[Block], quota: Mapping[Pool, int], move_penalty: float,
          relax: frozenset[str] = frozenset()) -> Milp:
    """The MILP over `blocks`, bound together by the quota of the pools in `quota` (others
    are left free). `relax` names constraint groups to leave out, for explanations."""
    rows = Rows()
    columns = Columns()
    removal_cols: list[tuple[int, int]] = []
    shortfall_cols: list[tuple[int, Pool]] = []
    starting = bool(blocks) and all(b.start is not None for b in blocks)
    pools: dict[Pool, list[tuple[int, int]]] = defaultdict(list)
    for b_index, b in enumerate(blocks):
        b.first_col = len(columns.cost)
        top = b.d.max_replicas if "max_replicas" not in relax else 10**6
        given = b.start or {}
        cols = [columns.add(c.usd_h, 0.0, float(top), True, float(given.get(j, 0)))
                for j, c in enumerate(b.cands)]
        for col, c in zip(cols, b.cands, strict=True):
            pools[c.pool].append((col, c.gpus))
        _add_size_rows(rows, b, cols, top, relax)
        if b.d.must_run:
            _add_spread_rows(rows, columns, b, cols, relax)
        removals = _add_removals(rows, columns, b, cols, move_penalty)
        removal_cols += [(u, b_index) for u in removals]
        if b.floor > 0:
            # No joint plan gives a deployment less than its optimum alone; stating so lifts
            # the LP bound of a joint model to the sum of those optima, which plain
            # relaxations miss by the rounding of whole replicas.
            rows.add([(col, c.usd_h) for col, c in zip(cols, b.cands, strict=True)]
                     + [(u, move_penalty) for u in removals], b.floor, math.inf)
    if "quota" not in relax:
        shortfall_cols = _add_quota_rows(rows, columns, pools, quota, relax)
    n = len(columns.cost)
    matrix = csc_matrix((rows.vals, (rows.rows, rows.cols)), shape=(len(rows.lower), n))
    return Milp(blocks, np.array(columns.cost, dtype=float),
                np.array(columns.lower, dtype=float), np.array(columns.upper, dtype=float),
                np.array(columns.integer, dtype=bool), matrix,
                np.array(rows.lower, dtype=float), np.array(rows.upper, dtype=float),
                removal_cols, shortfall_cols,
                np.array(columns.start, dtype=float) if starting else None)


def _add_size_rows(rows: Rows, b: Block, cols: list[int], top: int,
                   relax: frozenset[str]) -> None:
    """Demand, the replica bounds and the spot fraction of one deployment."""
    d = b.d
    need = d.required_tokens_per_s if "demand" not in relax else 0.0
    low = d.min_replicas if "min_replicas" not in relax else 0
    if need > 0 and cols:
        rows.add(((col, c.rate) for col, c in zip(cols, b.cands, strict=True)), need,
                 math.inf)
        # Σx ≥ ⌈need / fastest⌉ holds for every integer plan and tightens the relaxation.
        low = max(low, math.ceil(need / max(c.rate for c in b.cands) - 1e-9))
    if cols:
        rows.add(((col, 1.0) for col in cols), float(low), float(top))
    elif low > 0:
        rows.add((), float(low), math.inf)  # nothing may run, yet something must
    f = d.max_spot_fraction
    if f < 1 and "spot" not in relax and any(c.spot for c in b.cands):
        rows.add(((col, (1 - f) if c.spot else -f)
                  for col, c in zip(cols, b.cands, strict=True)), -math.inf, 0.0)


def _add_spread_rows(rows: Rows, columns: Columns, b: Block, cols: list[int],
                     relax: frozenset[str]) -> None:
    """At least k regions (clouds) used, with a binary per region (cloud) that is 1 only
    where the deployment runs a replica."""
    d = b.d
    for attr, k, name in (("region", d.spread_regions, "spread_regions"),
                          ("cloud", d.spread_clouds, "spread_clouds")):
        if k <= 1 or name in relax:
            continue
        members: dict[str, list[int]] = defaultdict(list)
        for col, c in zip(cols, b.cands, strict=True):
            members[getattr(c.offer, attr)].append(col)
        used = [columns.add(0.0, 0.0, 1.0, True,
                            float(any(columns.start[col] > 0 for col in group)))
                for group in members.values()]
        rows.add(((u, 1.0) for u in used), float(k), math.inf)
        for u, group in zip(used, members.values(), strict=True):
            rows.add([(u, 1.0)] + [(col, -1.0) for col in group], -math.inf, 0.0)


def _add_removals(rows: Rows, columns: Columns, b: Block, cols: list[int],
                  move_penalty: float) -> list[int]:
    """A column per running option that counts the replicas the plan removes from it."""
    index = {(c.offer.id, c.spot): col for col, c in zip(cols, b.cands, strict=True)}
    removals = []
    for key, count in b.running.items():
        if key in index:
            u = columns.add(move_penalty, 0.0, math.inf, False,
                            max(count - columns.start[index[key]], 0.0))
            removals.append(u)
            rows.add(((u, 1.0), (index[key], 1.0)), float(count), math.inf)
    return removals


def _add_quota_rows(rows: Rows, columns: Columns, pools: Mapping[Pool, list[tuple[int, int]]],
                    quota: Mapping[Pool, int], relax: frozenset[str]) -> list[tuple[int, Pool]]:
    """GPUs per pool within its quota (or, with `quota_elastic`, over it at a price); the
    shortfall columns of the elastic form."""
    shortfall_cols: list[tuple[int, Pool]] = []
    upper = columns.upper
    for pool, pool_cols in pools.items():
        limit = quota.get(pool)
        if limit is None:
            continue
        if sum(upper[col] * g for col, g in pool_cols) <= limit:
            continue  # cannot bind
        if "quota_elastic" in relax:
            # Every GPU over quota costs far more than any plan, so the solver uses
            # quota first and reports the least it must exceed it by.
            short = columns.add(ELASTIC_USD_PER_GPU, 0.0, math.inf, False)
            shortfall_cols.append((short, pool))
            rows.add([(short, -1.0)] + [(col, float(g)) for col, g in pool_cols],
                     -math.inf, float(limit))
        elif len(pool_cols) == 1:
            col, g = pool_cols[0]
            upper[col] = min(upper[col], limit // g)
        else:
            rows.add(((col, float(g)) for col, g in pool_cols), -math.inf, float(limit))
    return shortfall_cols


@dataclass
class Outcome:
    status: str  # optimal | feasible | infeasible | unsolved
    x: np.ndarray | None
    objective: float
    bound: float
    model: Milp | None = None
    columns: int = 0


# For the small models of deployments alone: HiGHS's root heuristics, restarts and symmetry
# detection cost more than the branching they save (measured: 2 ms a model instead of 15).
SMALL_MODEL_OPTIONS: dict[str, bool | str] = {
    "presolve": "off", "mip_allow_restart": False, "mip_detect_symmetry": False,
    "mip_heuristic_run_feasibility_jump": False, "mip_heuristic_run_rins": False,
    "mip_heuristic_run_rens": False, "mip_heuristic_run_root_reduced_cost": False,
}


def run(m: Milp, time_limit: float, gap: float, small: bool = False,
        abs_gap: float = 0.0) -> Outcome:
    if m.columns == 0:
        feasible = bool(np.all(m.row_lower <= 0) and np.all(m.row_upper >= 0))
        return Outcome("optimal" if feasible else "infeasible", np.zeros(0), 0.0, 0.0)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("time_limit", max(time_limit, 0.05))
    h.setOptionValue("mip_rel_gap", gap)
    h.setOptionValue("mip_abs_gap", max(abs_gap, 1e-6))
    for name, value in (SMALL_MODEL_OPTIONS.items() if small else ()):
        h.setOptionValue(name, value)
    lp = highspy.HighsLp()
    lp.num_col_ = m.columns
    lp.num_row_ = len(m.row_lower)
    lp.col_cost_ = m.cost
    lp.col_lower_ = m.lower
    lp.col_upper_ = m.upper
    lp.row_lower_ = m.row_lower
    lp.row_upper_ = m.row_upper
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = m.matrix.indptr
    lp.a_matrix_.index_ = m.matrix.indices
    lp.a_matrix_.value_ = m.matrix.data
    lp.a_matrix_.num_col_ = m.columns
    lp.a_matrix_.num_row_ = len(m.row_lower)
    kinds = (highspy.HighsVarType.kContinuous, highspy.HighsVarType.kInteger)
    lp.integrality_ = [kinds[int(i)] for i in m.integer]
    h.passModel(lp)
    if m.start is not None:
        # A plan known to be feasible: HiGHS starts from it as its incumbent and stops as
        # soon as the bound comes within the gap asked for.
        start = highspy.HighsSolution()
        start.col_value = m.start
        start.value_valid = True
        h.setSolution(start)
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    if status == highspy.HighsModelStatus.kInfeasible:
        return Outcome("infeasible", None, math.inf, math.inf)
    has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
    if not has_solution:
        return Outcome("unsolved", None, math.inf, -math.inf)
    x = np.array(h.getSolution().col_value)
    objective = float(info.objective_function_value)
    bound = float(info.mip_dual_bound)
    done = status == highspy.HighsModelStatus.kOptimal
    return Outcome("optimal" if done else "feasible", x, objective,
                   bound if math.isfinite(bound) else -math.inf)


@dataclass
class DeploymentPlan:
    """Replicas per option for one deployment, from a solved model."""

    counts: dict[int, int]  # candidate index → replicas
    objective: float
    bound: float
    status: str


def plans_from(m: Milp, out: Outcome) -> list[DeploymentPlan]:
    assert out.x is not None
    x = out.x
    plans = []
    for b in m.blocks:
        counts = {}
        for i in range(len(b.cands)):
            n = int(round(x[b.first_col + i]))
            if n > 0:
                counts[i] = n
        plans.append(DeploymentPlan(counts, 0.0, 0.0, out.status))
    # Objective and bound belong to the whole call; split the objective by block so that
    # plans from different calls add up.
    for b, plan in zip(m.blocks, plans, strict=True):
        plan.objective = sum(b.cands[i].usd_h * n for i, n in plan.counts.items())
    for col, b_index in m.removal_cols:
        plans[b_index].objective += m.cost[col] * max(x[col], 0.0)
    return plans

