"""What a deployment runs, taken from one of its revisions: the one place a revision's
engine settings are copied onto a deployment (promotion saves the copy; placement sizes an
unsaved one for a revision's replicas)."""

from __future__ import annotations

from controlplane.deployments.models import Deployment, Revision


def take_revision(deployment: Deployment, revision: Revision) -> Deployment:
    """`deployment` (changed in place, unsaved) running `revision`'s engine: its model,
    TP × PP, context length and prefix caching; engine arguments it leaves out keep the
    deployment's values. Residency, spread and spot rules stay the deployment's."""
    args = revision.engine_args
    deployment.model = revision.model
    deployment.tensor_parallel = revision.tensor_parallel
    deployment.pipeline_parallel = revision.pipeline_parallel
    deployment.max_model_len = int(args.get("max_model_len", deployment.max_model_len))
    deployment.enable_prefix_caching = bool(args.get("enable_prefix_caching",
                                                     deployment.enable_prefix_caching))
    return deployment
