"""One sequence for table versions, so they only grow across edges, workers and restarts."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("routing", "0001_initial")]
    operations = [
        migrations.RunSQL(
            "CREATE SEQUENCE IF NOT EXISTS routing_table_version_seq START 1",
            "DROP SEQUENCE IF EXISTS routing_table_version_seq",
        )
    ]
