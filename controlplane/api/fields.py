"""Serializer fields that name related rows the way people do: `aws:us-east-1`, `H100`, `EU`."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.relations import PKOnlyObject

from regions.models import Region


@extend_schema_field({"type": "string", "example": "aws:eu-central-1"})
class RegionKeyField(serializers.RelatedField):
    """A region as `cloud:code`."""

    default_error_messages = {
        "format": "Expected a region as 'cloud:code', e.g. 'aws:eu-central-1'; got {value!r}.",
        "missing": "Region {value!r} does not exist.",
    }

    def __init__(self, **kwargs: Any) -> None:
        if not kwargs.get("read_only"):
            kwargs.setdefault("queryset", Region.objects.select_related("cloud"))
        super().__init__(**kwargs)

    def to_representation(self, value: Region | PKOnlyObject) -> str:
        # use_pk_only_optimization() is off for this field: DRF always passes the row.
        assert isinstance(value, Region)
        return value.key

    def to_internal_value(self, data: Any) -> Region:
        if not isinstance(data, str) or data.count(":") != 1:
            self.fail("format", value=data)
        queryset = self.get_queryset()
        # RelatedField requires a queryset unless read-only, and read-only fields never parse.
        assert queryset is not None
        region = queryset.filter(**Region.key_filter(data)).first()
        if region is None:
            self.fail("missing", value=data)
        return region


def deployment_lookup(value: Any, prefix: str = "") -> dict[str, Any]:
    """How a deployment named in a URL, a filter or a body is found: all digits is its id
    (names never are: see `refuse_numeric_name`), anything else its name."""
    text = str(value)
    return {f"{prefix}pk" if text.isdigit() else f"{prefix}name": text}


def refuse_numeric_name(value: str) -> str:
    """Deployment names are slugs that must not look like ids, so that `/deployments/<x>/`
    means one thing: `12` is the deployment with id 12, never one named "12"."""
    if value.isdigit():
        raise serializers.ValidationError(
            "A deployment name cannot be only digits (those address deployments by id); "
            "add a letter, e.g. 'chat-" + value + "'.")
    return value


@extend_schema_field({"type": "string", "example": "chat-eu"})
class DeploymentRefField(serializers.RelatedField):
    """A deployment by name (or by id, when all digits)."""

    default_error_messages = {"missing": "Deployment {value!r} does not exist."}

    def to_representation(self, value: Any) -> str:
        return str(value.name)

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, (str, int)) or isinstance(data, bool) or data == "":
            self.fail("missing", value=data)
        queryset = self.get_queryset()
        assert queryset is not None
        found = queryset.filter(**deployment_lookup(data)).first()
        if found is None:
            self.fail("missing", value=data)
        return found
