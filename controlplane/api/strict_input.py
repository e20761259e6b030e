"""No body field silently ignored: every serializer a write of the REST API validates refuses
a field it does not take, or one it only shows (read-only), with a 400 naming it. Each write's
serializer derives from `StrictSerializer` or `StrictModelSerializer`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rest_framework import serializers


class RefusesUnknownFields:
    """Mixed into a serializer ahead of DRF's."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, Mapping):
            fields: Mapping[str, serializers.Field] = self.fields  # type: ignore[attr-defined]
            writable = sorted(name for name, field in fields.items() if not field.read_only)
            errors: dict[str, list[str]] = {}
            for name in data:
                if name in writable:
                    continue
                if name in fields:
                    errors[str(name)] = ["read-only; it cannot be set."]
                else:
                    errors[str(name)] = [f"unknown field; this takes: "
                                         f"{', '.join(writable) or 'no fields'}."]
            if errors:
                raise serializers.ValidationError(errors)
        return super().to_internal_value(data)  # type: ignore[misc]


class StrictSerializer(RefusesUnknownFields, serializers.Serializer):
    pass


class StrictModelSerializer(RefusesUnknownFields, serializers.ModelSerializer):
    pass
