"""Make the audit log append-only in the database itself: UPDATE and DELETE are refused."""

from django.db import migrations

FORWARD = """
CREATE OR REPLACE FUNCTION meridian_audit_append_only() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'core_auditlog is append-only: % refused', TG_OP;
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER core_auditlog_append_only
    BEFORE UPDATE OR DELETE ON core_auditlog
    FOR EACH ROW EXECUTE FUNCTION meridian_audit_append_only();
"""

BACKWARD = """
DROP TRIGGER IF EXISTS core_auditlog_append_only ON core_auditlog;
DROP FUNCTION IF EXISTS meridian_audit_append_only();
"""


class Migration(migrations.Migration):
    dependencies = [("core", "0001_initial")]
    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
