"""plotly.js, served from the installed plotly package so that no page needs a CDN."""

from __future__ import annotations

import gzip
from functools import lru_cache

import plotly
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET

# The URL carries the package version, so browsers may keep the file for a year.
CACHE_CONTROL = "public, max-age=31536000, immutable"


@lru_cache(maxsize=1)
def _plotly_js() -> tuple[bytes, bytes]:
    from plotly.offline import get_plotlyjs

    plain = get_plotlyjs().encode()
    return plain, gzip.compress(plain, compresslevel=6)


@require_GET
def plotly_js(request: HttpRequest, version: str) -> HttpResponse:
    plain, packed = _plotly_js()
    use_gzip = "gzip" in request.headers.get("Accept-Encoding", "")
    response = HttpResponse(packed if use_gzip else plain,
                            content_type="text/javascript; charset=utf-8")
    if use_gzip:
        response["Content-Encoding"] = "gzip"
    response["Vary"] = "Accept-Encoding"
    response["Cache-Control"] = CACHE_CONTROL
    return response


def plotly_version() -> str:
    return plotly.__version__
