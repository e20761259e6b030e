"""No query parameter silently ignored: a list answers 400 naming any parameter it does not
take (its filters, `ordering`, pagination and `format` are what it takes), any given twice, and
any true/false filter given something else. Views that are not lists of rows declare what
they take with `ChecksQueryParams`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db.models import QuerySet
from django_filters import BooleanFilter
from django_filters.rest_framework import DjangoFilterBackend
from rest_framework.exceptions import ValidationError
from rest_framework.filters import BaseFilterBackend
from rest_framework.request import Request
from rest_framework.settings import api_settings

from controlplane.api.ordering import PARAM as ORDERING

BOOLEAN_WORDS = {"true", "false", "1", "0"}


def refuse_unknown(request: Request, known: Iterable[str]) -> None:
    """400 naming each query parameter not in `known`, or given more than once."""
    allowed = sorted({*known, api_settings.URL_FORMAT_OVERRIDE or "format"})
    errors: dict[str, list[str]] = {}
    for name in request.query_params:
        if name not in allowed:
            errors[name] = [f"unknown query parameter; this endpoint takes: "
                            f"{', '.join(allowed)}."]
        elif name != ORDERING and len(request.query_params.getlist(name)) > 1:
            errors[name] = ["given more than once; give it once."]
    if errors:
        raise ValidationError(errors)


def _filters(request: Request, queryset: QuerySet, view: Any) -> dict[str, Any]:
    filterset_class = DjangoFilterBackend().get_filterset_class(view, queryset)
    return dict(filterset_class.base_filters) if filterset_class else {}


def _pagination_params(view: Any) -> list[str]:
    paginator = getattr(view, "paginator", None)
    if paginator is None:
        return []
    names = ("page_query_param", "page_size_query_param", "limit_query_param",
             "offset_query_param", "cursor_query_param")
    return [p for p in (getattr(paginator, n, None) for n in names) if p]


def _refuse_bad_booleans(request: Request, filters: dict[str, Any]) -> None:
    """django-filter reads a true/false filter's `maybe` as not given: refuse it instead."""
    errors = {name: [f"expected true or false, got {request.query_params[name]!r}."]
              for name, f in filters.items()
              if isinstance(f, BooleanFilter) and name in request.query_params
              and request.query_params[name].lower() not in BOOLEAN_WORDS | {""}}
    if errors:
        raise ValidationError(errors)


class KnownQueryParams(BaseFilterBackend):
    """First of the filter backends. On a list, refuses the parameters it would ignore."""

    def filter_queryset(self, request: Request, queryset: QuerySet, view: Any) -> QuerySet:
        if getattr(view, "action", None) != "list":
            return queryset
        filters = _filters(request, queryset, view)
        refuse_unknown(request, [*filters, ORDERING, *_pagination_params(view),
                                 *getattr(view, "extra_query_params", ())])
        _refuse_bad_booleans(request, filters)
        return queryset


class ChecksQueryParams:
    """For an APIView that is not a list of rows: `query_params` names what it takes; GETs
    with any other answer 400."""

    query_params: tuple[str, ...] = ()

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)  # type: ignore[misc]
        if request.method == "GET":
            refuse_unknown(request, self.query_params)
