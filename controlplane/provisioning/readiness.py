"""Whether an engine is ready to serve: /health answers 200 and /v1/models lists the model.

Works against vLLM's OpenAI server and enginesim alike; nothing here is simulator-specific.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass


@dataclass(frozen=True)
class Readiness:
    ready: bool
    detail: str


def engine_readiness(base_url: str, served_model_name: str, timeout_s: float = 2.0,
                     api_key: str | None = None,
                     context: ssl.SSLContext | None = None) -> Readiness:
    """`context`: the control plane's client certificate, for an engine that demands one."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = base_url.rstrip("/")
    try:
        request = urllib.request.Request(f"{base}/health", headers=headers)
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
            if response.status != 200:
                return Readiness(False, f"/health answered {response.status}")
        request = urllib.request.Request(f"{base}/v1/models", headers=headers)
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return Readiness(False, f"{exc.url} answered {exc.code}")
    except (OSError, ValueError) as exc:
        return Readiness(False, f"{type(exc).__name__}: {exc}")
    served = [model.get("id") for model in body.get("data", [])]
    if served_model_name not in served:
        return Readiness(False, f"/v1/models lists {served}, not {served_model_name!r}")
    return Readiness(True, "health 200 and model listed")
