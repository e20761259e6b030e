"""`?ordering=` on every list: the fields a view declares (and `id`), `-field` for descending,
several comma-separated; a field it does not know is a 400 naming it. Whatever the order asked
for, ties are broken by id, so pages never shuffle."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db.models import QuerySet
from rest_framework.exceptions import ValidationError
from rest_framework.filters import OrderingFilter
from rest_framework.request import Request

PARAM = "ordering"


def orderable_fields(view: Any) -> list[str]:
    """`id` first, then the view's `ordering_fields`, each once."""
    declared = getattr(view, "ordering_fields", None) or []
    assert declared != "__all__", f"{type(view).__name__}: name the orderable fields"
    return list(dict.fromkeys(["id", *declared]))


def _with_tie_breaker(fields: list[str]) -> list[str]:
    if not fields or {"id", "-id", "pk", "-pk"} & set(fields):
        return fields
    return [*fields, "-id" if fields[0].startswith("-") else "id"]


class StrictOrderingFilter(OrderingFilter):
    ordering_param = PARAM

    def get_valid_fields(self, queryset: QuerySet, view: Any,
                         context: Mapping[str, Any] | None = None) -> list[tuple[str, str]]:
        return [(field, field) for field in orderable_fields(view)]

    def requested(self, request: Request, view: Any) -> list[str] | None:
        values = request.query_params.getlist(self.ordering_param)
        if not values:
            return None
        fields = [part.strip() for value in values for part in value.split(",")]
        allowed = orderable_fields(view)
        unknown = [f for f in fields if f.removeprefix("-") not in allowed or not f]
        if unknown:
            names = ", ".join(repr(f) for f in unknown)
            raise ValidationError({self.ordering_param: [
                f"unknown field{'s' if len(unknown) > 1 else ''} {names}; allowed: "
                f"{', '.join(allowed)} (each may start with '-' for descending)."]})
        return fields

    def default(self, queryset: QuerySet, view: Any) -> list[str]:
        declared = getattr(view, "ordering", None)
        if isinstance(declared, str):
            declared = [declared]
        fields = list(declared or queryset.query.order_by or queryset.model._meta.ordering)
        if not all(isinstance(f, str) for f in fields):
            return []  # an expression: left as the queryset has it
        return fields or ["id"]

    def filter_queryset(self, request: Request, queryset: QuerySet, view: Any) -> QuerySet:
        fields = self.requested(request, view) or self.default(queryset, view)
        if not fields:
            return queryset
        return queryset.order_by(*_with_tie_breaker(fields))

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        allowed = orderable_fields(view)
        return [{
            "name": self.ordering_param,
            "required": False,
            "in": "query",
            "description": (f"Sort by {', '.join(allowed)}; '-' before a field for "
                            "descending, several comma-separated. Ties go by id."),
            "style": "form",
            "explode": False,
            "schema": {"type": "array", "items": {
                "type": "string", "enum": [v for f in allowed for v in (f, f"-{f}")]}},
        }]
