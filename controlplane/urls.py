"""Top-level routes: the API, its schema and docs, OpenAI's Files and Batches (/v1/), the
admin, and the dashboard."""

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from controlplane.api.urls import openai_urlpatterns

urlpatterns = [
    path("api/v1/", include("controlplane.api.urls")),
    path("v1/", include(openai_urlpatterns)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="swagger-ui"),
    path("admin/", admin.site.urls),
    path("", include("frontend.urls")),
]
