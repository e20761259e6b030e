"""Progressive rollouts of a deployment's new revision: canary steps, each a traffic weight
held for a bake time, with the decision taken at its end."""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from controlplane.core.tenancy import Tenancy, TenantQuerySet
from controlplane.deployments.models import Deployment, Revision


class Strategy(models.TextChoices):
    CANARY = "canary", "Canary"
    # The whole new set brought up beside the old, all traffic switched at once, the old set
    # kept serving nothing for a rollback window, then retired.
    BLUE_GREEN = "blue_green", "Blue/green"


class RolloutState(models.TextChoices):
    PENDING = "pending", "Pending"
    RUNNING = "running", "Running"
    PAUSED = "paused", "Paused"
    PROMOTED = "promoted", "Promoted"
    ROLLED_BACK = "rolled_back", "Rolled back"


IN_PROGRESS = (RolloutState.PENDING, RolloutState.RUNNING, RolloutState.PAUSED)


class Rollout(models.Model):
    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="rollouts")
    from_revision = models.ForeignKey(Revision, on_delete=models.PROTECT, related_name="+")
    to_revision = models.ForeignKey(Revision, on_delete=models.PROTECT, related_name="+")
    strategy = models.CharField(max_length=16, choices=Strategy.choices,
                                default=Strategy.CANARY)
    steps = models.JSONField(help_text="Canary weights (%), increasing, ending at 100.")
    bake_s = models.PositiveIntegerField(validators=[MinValueValidator(1)],
                                         help_text="How long each step is held (seconds).")
    rollback_window_s = models.PositiveIntegerField(
        default=0, help_text="Blue/green: how long the old set is kept after the switch, the "
                             "new one judged all the while, before it is promoted and the old "
                             "set retired.")
    auto_promote = models.BooleanField(default=True, help_text=(
        "Canary: promote once the last step's analysis passes; false: the last step waits "
        "for an operator's promote."))
    waves = models.JSONField(default=list, blank=True, help_text=(
        "Canary in waves: lists of edge regions (cloud:code), each taken through every step "
        "in turn, earlier waves staying at 100%; empty: every edge at once."))
    state = models.CharField(max_length=16, choices=RolloutState.choices,
                             default=RolloutState.PENDING, db_index=True)
    current_wave = models.PositiveSmallIntegerField(default=0)
    current_step = models.PositiveSmallIntegerField(default=0)
    thresholds = models.JSONField(default=dict, blank=True, help_text=(
        "What each step is judged by (rollouts.analysis.DEFAULT_THRESHOLDS, the TTFT limit "
        "defaulting to the deployment's SLO)."))
    start_reason = models.TextField(blank=True, default="", help_text=(
        "Why it was started, as whoever started it said."))
    reason = models.TextField(blank=True, default="", help_text="Why it ended as it did.")
    ended_by = models.CharField(max_length=150, blank=True, default="",
                                help_text="Who ended it: an operator, or rollouts.analysis.")
    replicas_wanted = models.PositiveIntegerField(null=True, blank=True, help_text=(
        "Set at promotion: how many of the new revision's replicas serve before the old "
        "revision's are drained and retired (make-before-break)."))
    old_retired_at = models.DateTimeField(null=True, blank=True, help_text=(
        "When the old revision's replicas were drained after promotion (or, rolled back, "
        "the canary's); empty while a promotion waits for the new ones to serve."))
    created_by = models.CharField(max_length=150, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    tenancy = Tenancy("deployment__tenant", shared=True)
    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            # A deployment has at most one rollout in progress.
            models.UniqueConstraint(
                fields=["deployment"],
                condition=models.Q(state__in=["pending", "running", "paused"]),
                name="one_rollout_in_progress_per_deployment",
            ),
        ]

    def __str__(self) -> str:
        return f"rollout {self.pk} of {self.deployment.name} ({self.state})"  # as the pages

    @property
    def weight(self) -> int:
        """The canary's current share (%): the current step's while in progress."""
        if self.state in IN_PROGRESS and self.steps:
            return int(self.steps[min(self.current_step, len(self.steps) - 1)])
        return 100 if self.state == RolloutState.PROMOTED else 0


class RolloutStep(models.Model):
    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, related_name="step_rows")
    wave = models.PositiveSmallIntegerField(default=0)
    step = models.PositiveSmallIntegerField()
    weight = models.PositiveSmallIntegerField(validators=[MaxValueValidator(100)])
    started_at = models.DateTimeField(auto_now_add=True)
    ready_at = models.DateTimeField(null=True, blank=True, help_text=(
        "When the canary's replicas for this weight were serving and the weight went into "
        "the tables; the step bakes and is judged from then."))
    ended_at = models.DateTimeField(null=True, blank=True)
    analysis = models.JSONField(default=dict, blank=True,
                                help_text="The figures the decision was taken on.")
    decision = models.CharField(max_length=32, blank=True, default="",
                                help_text="advanced, promoted, rolled_back, or no_data (held "
                                          "for too little traffic); empty while it runs.")
    extensions = models.PositiveSmallIntegerField(
        default=0, help_text="Bake times added for too little traffic.")

    tenancy = Tenancy("rollout__deployment__tenant", shared=True)
    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["rollout_id", "wave", "step", "id"]
