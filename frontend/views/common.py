"""What every page shares: the gate each view passes (`dashboard_view`), the 403 page, the
navigation, the viewer's role in the context, pagination."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.views import redirect_to_login
from django.core.paginator import Page, Paginator
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import render

from controlplane.core.models import Role
from frontend.access import may_see_page, page_refusal, principal_of

View = Callable[..., HttpResponse]

# (url name, label, what the page answers): one <nav> links every page from here.
NAV: tuple[tuple[str, str, str], ...] = (
    ("overview", "Overview", "Where the fleet runs and whether it is healthy"),
    ("inventory", "Regions & inventory", "Clouds, regions, GPU prices and quota"),
    ("deployments", "Deployments", "What is served, where, and at what cost"),
    ("plans", "Plans", "Placement changes proposed by the solver"),
    ("rollouts", "Rollouts", "New revisions on a growing share of traffic, judged at each step"),
    ("routing", "Routing", "Edges and the tables they route by"),
    ("costs", "Costs", "Spend by model, region and tenant; budgets"),
    ("batches", "Batches", "Batch jobs: progress, errors, cancel"),
    ("alerts", "Alerts", "What is wrong now, and what was"),
    ("failover", "Failover", "Region health, incidents and drills"),
    ("events", "Events", "Who or what changed what, and why"),
    ("tenants", "Tenants & keys", "Customers, their limits and API keys"),
)
PAGE_SIZE = 50


def page_context(request: HttpRequest, context: dict[str, Any] | None = None) -> dict[str, Any]:
    principal = principal_of(request)
    current = request.resolver_match.url_name if request.resolver_match else ""
    section = getattr(request, "nav_section", None) or current
    return {
        "principal": principal,
        "can_operate": principal.has_role(Role.OPERATOR),
        "can_admin": principal.has_role(Role.ADMIN),
        "nav": [{"name": name, "label": label, "hint": hint, "current": name == section}
                for name, label, hint in NAV
                if may_see_page(principal, name)],
        **(context or {}),
    }


def render_page(request: HttpRequest, template: str, context: dict[str, Any] | None = None,
                *, section: str | None = None, status: int = 200) -> HttpResponse:
    """Render a dashboard page; `section` marks which nav entry it belongs to."""
    if section:
        request.nav_section = section  # type: ignore[attr-defined]
    return render(request, template, page_context(request, context), status=status)


def forbidden(request: HttpRequest, message: str) -> HttpResponse:
    return render(request, "frontend/forbidden.html",
                  page_context(request, {"message": message}), status=403)


def dashboard_view(
    role: str = Role.VIEWER, methods: tuple[str, ...] = ("GET",), platform_only: bool = False,
) -> Callable[[View], View]:
    """Signed-in users with at least `role` only (platform staff alone with
    `platform_only`); other methods are refused with 405."""

    def decorate(view: View) -> View:
        @wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path())
            if request.method not in methods:
                return HttpResponseNotAllowed(methods)
            reason = page_refusal(principal_of(request), role, platform_only)
            if reason:
                return forbidden(request, reason)
            return view(request, *args, **kwargs)

        return wrapped

    return decorate


def paginate(request: HttpRequest, queryset: Any, per_page: int = PAGE_SIZE) -> Page:
    return Paginator(queryset, per_page).get_page(request.GET.get("page"))


def query_without_page(request: HttpRequest) -> str:
    """The current filters as a query string, for pagination links to keep them."""
    params = request.GET.copy()
    params.pop("page", None)
    return params.urlencode()
