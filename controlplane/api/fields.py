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
