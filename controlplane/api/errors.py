"""Turns database refusals into clear 4xx answers instead of 500s."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import DataError, IntegrityError
from django.db.models import ProtectedError, RestrictedError
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, (ProtectedError, RestrictedError)):
        blockers = sorted({str(obj._meta.verbose_name_plural) for obj in exc.protected_objects}) \
            if isinstance(exc, ProtectedError) else []
        what = ", ".join(blockers) or "other objects"
        return Response(
            {"detail": f"Cannot delete: still referenced by {what}. Remove those first."},
            status=status.HTTP_409_CONFLICT,
        )
    if isinstance(exc, DjangoValidationError):
        body = exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages}
        return Response(body, status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, DataError):
        return Response(
            {"detail": f"A value is out of range or malformed: {str(exc).splitlines()[0]}"},
            status=status.HTTP_400_BAD_REQUEST,
        )
    if isinstance(exc, IntegrityError):
        return Response(
            {"detail": f"Conflicts with a stored row: {str(exc).splitlines()[0]}"},
            status=status.HTTP_409_CONFLICT,
        )
    return drf_exception_handler(exc, context)
