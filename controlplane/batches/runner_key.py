"""The key a batch's lines are sent to an edge with: the tenant's identity, at batch tier.

The edge knows tenants by their keys' hashes, and the control plane keeps no key's secret,
so each batch gets a key of its own: an ApiKey of the batch's tenant (tier batch, the
batch's model only), whose secret is derived with HMAC from a secret of its own,
`MERIDIAN_BATCH_KEY_SECRET` (settings.BATCH_KEY_SECRET), and the batch id. Any worker can
derive it again and nothing secret is stored; the row reaches the edges' tables like any key,
and is revoked when the batch finishes. The batch id is no secret (it is in every line's
x-request-id), and neither SECRET_KEY nor the id alone gives the key away.
"""

from __future__ import annotations

import hashlib
import hmac

from django.conf import settings

from controlplane.batches.models import Batch
from controlplane.core.hashing import KEY_PREFIX, display_prefix, sha256_hex
from controlplane.core.models import ApiKey, Role, Tier
from controlplane.core.services import Principal, set_key_revoked

# Who revokes a finished batch's key.
RUNNER = Principal("system:batches", Role.ADMIN, None)


def key_name(batch_id: str) -> str:
    return f"batch {batch_id}"


def runner_secret(batch_id: str) -> str:
    digest = hmac.new(settings.BATCH_KEY_SECRET.encode(), f"meridian-batch:{batch_id}".encode(),
                      hashlib.sha256).hexdigest()
    return KEY_PREFIX + "b" + digest


def ensure_runner_key(batch: Batch) -> str:
    """The batch's key (made on first use); returns its secret."""
    secret = runner_secret(batch.pk)
    ApiKey.objects.get_or_create(
        key_hash=sha256_hex(secret),
        defaults={"tenant_id": batch.tenant_id, "name": key_name(batch.pk), "tier": Tier.BATCH,
                  "allowed_models": [batch.model], "prefix": display_prefix(secret)})
    return secret


def revoke_runner_key(batch_id: str) -> None:
    # One save per row (there is at most one) so the edges' tables drop it. The platform
    # revokes it, so the tenant's admins cannot restore it.
    for key in ApiKey.objects.filter(key_hash=sha256_hex(runner_secret(batch_id)),
                                     revoked_at__isnull=True):
        set_key_revoked(key, True, RUNNER)
