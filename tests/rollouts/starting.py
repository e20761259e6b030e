"""Starting a rollout in tests as the API does: the settings checked and typed
(`validation.rollout_request`), then `lifecycle.start`."""

from __future__ import annotations

from controlplane.deployments.models import Deployment
from controlplane.rollouts import lifecycle, validation
from controlplane.rollouts.models import Rollout

REVISION_FIELDS = ("model", "vllm_version", "engine_args", "tensor_parallel",
                   "pipeline_parallel", "preferred_gpu_type")


def start_rollout(deployment: Deployment, *, actor: str, reason: str = "",
                  **settings: object) -> Rollout:
    """A rollout of `deployment` with `settings` as a request body gives them (the new
    revision's among them)."""
    revision = validation.RevisionSpec(**{name: settings.pop(name) for name in REVISION_FIELDS
                                          if name in settings})  # type: ignore[arg-type]
    wanted = validation.rollout_request(deployment, settings, revision, reason=reason)
    return lifecycle.start(deployment, wanted, actor=actor)
