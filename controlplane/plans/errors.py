"""Why a plan step was refused: each answers 409 in the API and a message on the dashboard."""

from __future__ import annotations


class PlanStateError(Exception):
    """The plan is not in a state that allows this action."""


class PlanSupersededError(PlanStateError):
    """A newer plan over the same deployments replaced this one."""

    def __init__(self, plan_id: int, by: int | None) -> None:
        self.plan_id, self.by = plan_id, by
        newer = f"plan {by}" if by is not None else "a newer plan"
        super().__init__(f"plan {plan_id} is superseded by {newer}, proposed over the same "
                         f"deployments since; review {newer} instead")


class PlanStaleError(PlanStateError):
    """The fleet moved since the plan was computed: the plan is for a fleet that is gone."""

    def __init__(self, plan_id: int, changed: list[str]) -> None:
        self.plan_id, self.changed = plan_id, changed
        super().__init__(f"plan {plan_id} was computed from a fleet that has moved since: "
                         f"{'; '.join(changed)}. Nothing was changed; propose a plan again")
