"""Each replica's own engine API key, derived rather than stored.

key = "sk-engine-" + base64url(HMAC-SHA256(secret, "meridian engine key v1\\0" + replica id)),
with the secret MERIDIAN_ENGINE_KEY_SECRET (else SECRET_KEY, under that label). The engine
gets it through its environment (`VLLM_API_KEY`, which vLLM reads when `--api-key` is not
given), never on its command line; edges get it from their signed table (`engine_key`). One
replica's key opens no other replica.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os

from django.conf import settings

LABEL = b"meridian engine key v1\0"


def engine_key(replica_id: str) -> str:
    secret = os.environ.get("MERIDIAN_ENGINE_KEY_SECRET") or settings.SECRET_KEY
    digest = hmac.new(secret.encode(), LABEL + replica_id.encode(), hashlib.sha256).digest()
    return "sk-engine-" + base64.urlsafe_b64encode(digest).decode().rstrip("=")
