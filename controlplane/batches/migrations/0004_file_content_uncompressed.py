"""A file's content is stored uncompressed (EXTERNAL), so that reading it back a chunk at a
time (`substring`, batches.services.stored_chunks) reads only that chunk instead of
decompressing the value from its start for every chunk. Values stored before keep their
compression and are still read correctly, only slower."""

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("batches", "0003_audit_triggers"),
    ]

    operations = [
        migrations.RunSQL(
            "ALTER TABLE batches_batchfile ALTER COLUMN content SET STORAGE EXTERNAL",
            reverse_sql="ALTER TABLE batches_batchfile ALTER COLUMN content SET STORAGE EXTENDED",
        ),
    ]
