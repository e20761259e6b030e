"""Renewed certificates onto SkyPilot nodes: the replica's new pair, written where its engine
reads it, by a small job on the replica's own cluster.

A replica's server certificate is renewed on the control plane (`core.renew_certificates`,
in its directory under var/engine-tls/). A local engine reads that directory itself; a cloud
node holds the copy its launch wrote. `deliver` submits `sky.exec` of a job that writes the
new files beside the old ones and moves them into place (key, then certificate), so vLLM's
`--enable-ssl-refresh` picks up a complete pair; the PEM text travels as SkyPilot secrets,
never in the task's YAML or on a command line. The job needs no accelerator, so it runs
beside the `vllm serve` job. `job_state` tells whether that job has ended well.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import yaml

from controlplane.provisioning.base import ProviderError
from controlplane.provisioning.skypilot_task import REMOTE_TLS_DIR, TLS_SECRETS

# What the files are called on the node, in the order the job moves them into place.
REFRESH_ORDER = (("MERIDIAN_TLS_CA", "ca.pem"), ("MERIDIAN_TLS_KEY", "key.pem"),
                 ("MERIDIAN_TLS_CERT", "cert.pem"))
LOCAL_FILES = dict(zip(TLS_SECRETS, ("cert.pem", "key.pem", "ca.pem"), strict=True))
JOB_DONE, JOB_PENDING, JOB_FAILED = "done", "pending", "failed"


def tls_secrets(tls_dir: str | Path) -> list[tuple[str, str]]:
    """The replica's certificate, key and the CA as PEM text, named as the task's secrets;
    ProviderError('credentials') naming the directory when they cannot be read."""
    directory = Path(tls_dir)
    try:
        return [(name, (directory / LOCAL_FILES[name]).read_text()) for name in TLS_SECRETS]
    except OSError as exc:
        raise ProviderError("credentials", f"the replica's TLS files in {directory} cannot be "
                                           f"read: {exc}") from exc


def refresh_script(remote_dir: str = REMOTE_TLS_DIR) -> str:
    """Write each file beside its old self (0600, the key's directory 0700), then rename it
    over the old one: a reader sees the old file or the new one, never half of either."""
    directory = shlex.quote(remote_dir)
    lines = ["set -euo pipefail", "umask 077", f"mkdir -p {directory}"]
    for secret, name in REFRESH_ORDER:
        lines.append(f"printf '%s\\n' \"${secret}\" > {directory}/.{name}.new && "
                     f"mv -f {directory}/.{name}.new {directory}/{name}")
    return "\n".join(lines) + "\n"


def refresh_task_yaml(replica_id: str) -> str:
    """The job's task: no resources asked (it runs beside the engine), secrets declared
    without values (filled in at submission)."""
    config = {"name": f"meridian-tls-{replica_id}"[:60],
              "secrets": {name: None for name in TLS_SECRETS},
              "run": refresh_script()}
    return yaml.safe_dump(config, sort_keys=False)


def submitted_job_id(result: Any) -> str:
    """`sky.exec`'s result is (job_id, handle); the job id as text, or ProviderError."""
    job_id = result[0] if isinstance(result, tuple | list) and result else None
    if job_id is None:
        raise ProviderError("other", f"sky.exec returned no job id ({result!r})")
    return str(job_id)


def job_state(statuses: Any, job_id: str) -> str:
    """done / pending / failed for the job `job_id` in `sky.job_status`'s answer (a job the
    cluster no longer lists has failed: the certificate is sent again)."""
    found = dict(statuses or {})
    state = found.get(job_id, found.get(int(job_id)) if job_id.isdigit() else None)
    name = str(getattr(state, "value", state) or "").upper()
    if name == "SUCCEEDED":
        return JOB_DONE
    if name in ("INIT", "PENDING", "SETTING_UP", "RUNNING"):
        return JOB_PENDING
    return JOB_FAILED
