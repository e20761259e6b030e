"""The REST API under /api/v1/: serializers, viewsets, permissions and the OpenAPI schema."""
