"""DRF authentication by `Authorization: Bearer <token>` against hashed API tokens."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from controlplane.core.services import user_for_token


class BearerTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[Any, None] | None:
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        scheme, _, token = header.partition(" ")
        if scheme.lower() != self.keyword.lower():
            return None
        token = token.strip()
        if not token or " " in token:
            raise exceptions.AuthenticationFailed("Authorization header must be 'Bearer <token>'.")
        user = user_for_token(token)
        if user is None:
            raise exceptions.AuthenticationFailed("Unknown, revoked or expired token.")
        return user, None

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """Documents the bearer token in the OpenAPI schema."""

    target_class = BearerTokenAuthentication
    name = "BearerAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer"}
