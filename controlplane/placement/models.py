"""Plans: proposed replica changes with their reasons and cost, and what became of them."""

from __future__ import annotations

from django.db import models

from controlplane.core.tenancy import Tenancy, TenantQuerySet


class PlanStatus(models.TextChoices):
    PROPOSED = "proposed", "Proposed"
    APPROVED = "approved", "Approved"
    APPLYING = "applying", "Applying"
    APPLIED = "applied", "Applied"
    REJECTED = "rejected", "Rejected"
    INFEASIBLE = "infeasible", "Infeasible"
    FAILED = "failed", "Failed"
    SUPERSEDED = "superseded", "Superseded"


# Plans that have not acted yet: a newer plan over the same deployments supersedes them.
OPEN_STATUSES = (PlanStatus.PROPOSED, PlanStatus.APPROVED)


class Plan(models.Model):
    """One solver run over some deployments: its inputs, result and review trail."""

    status = models.CharField(
        max_length=16, choices=PlanStatus.choices, default=PlanStatus.PROPOSED, db_index=True
    )
    trigger = models.CharField(max_length=64, default="manual")
    scope = models.JSONField(default=list, blank=True, help_text="Deployment names; [] = all.")
    inputs = models.JSONField(default=dict, blank=True)
    explanation = models.TextField(blank=True)
    cost_before_usd_h = models.DecimalField(max_digits=14, decimal_places=4, default=0)
    # None when there is no plan (infeasible): there is no "after" to state.
    cost_after_usd_h = models.DecimalField(max_digits=14, decimal_places=4, null=True,
                                           blank=True, default=0)
    solver = models.JSONField(default=dict, blank=True, help_text="status, solve_s, gap, bound")
    proposed_by = models.CharField(max_length=150)
    created_at = models.DateTimeField(auto_now_add=True)
    reviewed_by = models.CharField(max_length=150, blank=True)
    reviewed_at = models.DateTimeField(null=True, blank=True)
    applied_at = models.DateTimeField(null=True, blank=True)
    log = models.TextField(blank=True)
    # The fleet state the plan was computed from (placement.basis): what approve and apply
    # check, in their transaction, before they act.
    basis = models.JSONField(
        default=dict, blank=True,
        help_text="Per deployment in scope: its rule inputs and the replicas the solver "
                  "counted (state, region, offer, spot), as they were when proposed.")
    basis_fingerprint = models.CharField(
        max_length=64, blank=True,
        help_text="sha256 of what in `basis` the solver reads; empty for plans stored "
                  "before plans recorded it.")
    superseded_by = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="supersedes",
        help_text="The newer plan over the same deployments that replaced this one.")

    class Meta:
        ordering = ["-created_at", "-id"]

    @property
    def has_plan(self) -> bool:
        return self.status != PlanStatus.INFEASIBLE and self.cost_after_usd_h is not None

    @property
    def saving_usd_h(self) -> float | None:
        """$/h the plan saves (negative: what it adds); None when there is no plan."""
        if not self.has_plan:
            return None
        assert self.cost_after_usd_h is not None
        return float(self.cost_before_usd_h - self.cost_after_usd_h)

    @property
    def extra_usd_h(self) -> float:
        """What the plan adds to the fleet's $/h (0 when it saves, or has no plan)."""
        return max(-(self.saving_usd_h or 0.0), 0.0)

    @property
    def unplaced(self) -> list[dict[str, str]]:
        """Deployments the plan could not place, with why ({"deployment", "reason"})."""
        return list((self.inputs or {}).get("unplaced", []))

    def __str__(self) -> str:
        return f"plan {self.pk} ({self.status})"


class ChangeAction(models.TextChoices):
    ADD = "add", "Add"
    REMOVE = "remove", "Remove"


class PlanChange(models.Model):
    plan = models.ForeignKey(Plan, on_delete=models.CASCADE, related_name="changes")
    deployment = models.ForeignKey(
        "deployments.Deployment", on_delete=models.CASCADE, related_name="plan_changes"
    )
    action = models.CharField(max_length=8, choices=ChangeAction.choices)
    region = models.ForeignKey("regions.Region", on_delete=models.PROTECT, related_name="+")
    offer = models.ForeignKey(
        "regions.Offer", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    count = models.PositiveIntegerField()
    spot = models.BooleanField(default=False)
    usd_h_delta = models.DecimalField(max_digits=14, decimal_places=4, default=0)
    reason = models.TextField()
    replica_ids = models.JSONField(
        default=list, blank=True, help_text="Replicas this change created or drained."
    )

    tenancy = Tenancy("deployment__tenant", shared=True)
    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["plan", "deployment__name", "action", "id"]

    def __str__(self) -> str:
        return f"{self.action} {self.count} × {self.deployment} @ {self.region}"
