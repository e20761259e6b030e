"""ScalingDecision now belongs to the scaling app (scaling/0001); its table is kept."""

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("failover", "0001_initial"),
        ("scaling", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="ScalingDecision")],
            database_operations=[],
        ),
    ]
