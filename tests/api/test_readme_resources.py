"""The README lists every resource the API serves, and nothing it does not."""

from __future__ import annotations

import re
from pathlib import Path

from django.urls import URLPattern

from controlplane.api.urls import router, urlpatterns

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_resources() -> set[str]:
    text = README.read_text()
    paragraph = text[text.index("Resources: "):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    return set(re.findall(r"`([a-z][a-z-]*)`", paragraph))


def served_resources() -> set[str]:
    prefixes = {prefix for prefix, _viewset, _basename in router.registry}
    routes = {str(p.pattern).rstrip("/") for p in urlpatterns
              if isinstance(p, URLPattern) and "<" not in str(p.pattern)}
    return prefixes | {r for r in routes if r and "/" not in r and "." not in r}


def test_readme_lists_exactly_the_resources_the_router_serves() -> None:
    served, listed = served_resources(), readme_resources()
    assert "deployments" in served and "status" in served
    assert served - listed == set(), "the README misses these"
    assert listed - served == set(), "the README names resources the API does not serve"
