"""Forms of the dashboard: page filters and the inputs of operator and admin actions."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django import forms
from django.core.validators import RegexValidator

from controlplane.core.models import Tier


def _choices(values: Iterable[tuple[str, str]], everything: str) -> list[tuple[str, str]]:
    return [("", everything), *values]


def _offer(form: forms.Form, name: str, choices: Iterable[tuple[str, str]]) -> None:
    """Set a choice field's options from the database at request time."""
    field = form.fields[name]
    assert isinstance(field, forms.ChoiceField)
    field.choices = list(choices)


class InventoryFilter(forms.Form):
    TABS = (("offers", "GPU offers"), ("regions", "Regions"))
    SORTS = (("region", "region"), ("on_demand", "on-demand price"), ("spot", "spot price"),
             ("per_gpu", "price per GPU"))

    tab = forms.ChoiceField(choices=TABS, required=False)
    jurisdiction = forms.ChoiceField(required=False)
    gpu = forms.ChoiceField(required=False, label="GPU")
    cloud = forms.ChoiceField(required=False)
    sort = forms.ChoiceField(choices=SORTS, required=False)

    def __init__(self, data: Any, *, jurisdictions: Iterable[tuple[str, str]],
                 gpus: Iterable[str], clouds: Iterable[tuple[str, str]]) -> None:
        super().__init__(data)
        _offer(self, "jurisdiction", _choices(
            ((code, f"{code} · {name}") for code, name in jurisdictions), "all jurisdictions"))
        _offer(self, "gpu", _choices(((g, g) for g in gpus), "all GPUs"))
        _offer(self, "cloud", _choices(clouds, "all clouds"))


class EventFilter(forms.Form):
    actor = forms.CharField(required=False, max_length=150)
    action = forms.ChoiceField(required=False)
    object_type = forms.ChoiceField(required=False, label="About")
    since = forms.DateTimeField(required=False, widget=forms.DateTimeInput(
        attrs={"type": "datetime-local"}), help_text="UTC")

    def __init__(self, data: Any, *, actions: Iterable[str], object_types: Iterable[str]) -> None:
        super().__init__(data)
        _offer(self, "action", _choices(((a, a) for a in actions), "any action"))
        _offer(self, "object_type", _choices(((t, t) for t in object_types), "anything"))


class ScaleForm(forms.Form):
    region = forms.ChoiceField(help_text="Regions in the deployment's allowed jurisdictions.")
    replicas = forms.IntegerField(min_value=0, max_value=64,
                                  help_text="How many replicas should run in this region.")
    spot = forms.BooleanField(required=False, help_text="New replicas use spot capacity.")
    reason = forms.CharField(required=False, max_length=500,
                             help_text="Recorded in the audit log with your name.")

    def __init__(self, data: Any = None, *, regions: Iterable[tuple[str, str]],
                 initial: dict[str, Any] | None = None) -> None:
        super().__init__(data, initial=initial)
        _offer(self, "region", regions)


class ReasonForm(forms.Form):
    reason = forms.CharField(required=False, max_length=500)


class ApiKeyForm(forms.Form):
    name = forms.CharField(
        max_length=64, validators=[RegexValidator(r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                                                  "Use letters, digits, '.', '_' and '-'.")],
        help_text="What the key is for, e.g. 'web-app' or 'batch-eval'.")
    tier = forms.ChoiceField(
        choices=Tier.choices, initial=Tier.INTERACTIVE,
        help_text="Interactive requests are routed for latency; batch for cost.")
    allowed_models = forms.CharField(
        required=False, initial="*", max_length=2000,
        help_text="Served model names, separated by commas; * for every model.")

    def clean_allowed_models(self) -> list[str]:
        names = [n.strip() for n in self.cleaned_data["allowed_models"].split(",") if n.strip()]
        return names or ["*"]
