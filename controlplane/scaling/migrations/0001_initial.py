"""ScalingDecision moves here from the failover app. Its table stays where it is
(`failover_scalingdecision`), so only Django's record of which app owns the model changes."""

import django.db.models.deletion
from django.db import migrations, models


def _move_content_type(apps, schema_editor, old: str, new: str) -> None:
    """Keep permissions and admin history attached to the model under its new app."""
    content_types = apps.get_model("contenttypes", "ContentType")
    if not content_types.objects.filter(app_label=new, model="scalingdecision").exists():
        content_types.objects.filter(app_label=old, model="scalingdecision").update(
            app_label=new)


def forwards(apps, schema_editor):
    _move_content_type(apps, schema_editor, "failover", "scaling")


def backwards(apps, schema_editor):
    _move_content_type(apps, schema_editor, "scaling", "failover")


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ("contenttypes", "0002_remove_content_type_name"),
        ("deployments", "0002_deployment_autoscale_and_more"),
        ("failover", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="ScalingDecision",
                    fields=[
                        ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                        ("at", models.DateTimeField(db_index=True)),
                        ("direction", models.CharField(max_length=8)),
                        ("replicas_before", models.PositiveIntegerField()),
                        ("replicas_after", models.PositiveIntegerField()),
                        ("reason", models.CharField(max_length=300)),
                        ("signals", models.JSONField(default=dict)),
                        ("placed", models.JSONField(blank=True, default=list, help_text="region keys of new replicas")),
                        ("deployment", models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name="scaling_decisions", to="deployments.deployment")),
                    ],
                    options={
                        "ordering": ["-at"],
                        "db_table": "failover_scalingdecision",
                    },
                ),
            ],
            database_operations=[],
        ),
        migrations.RunPython(forwards, backwards),
    ]
