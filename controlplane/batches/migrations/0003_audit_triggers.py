"""Every change to a batch or an input file is an audit event, written by the database.

Triggers on `batches_batch` and `batches_batchfile` append to `core_auditlog` in the same
transaction as the change, so an event exists exactly when the change does, whichever code
made it (the API, the dashboard, a worker's conditional UPDATE). The actor and reason are
the connection's `meridian.audit_actor` and `meridian.audit_reason` settings
(`controlplane.batches.audit.acting_as`), else `system:batches`.

Batch events follow OpenAI's timestamps: each of in_progress_at, cancelling_at,
finalizing_at, completed_at, failed_at, expired_at and cancelled_at that becomes set is one
event (`batch.<stage>`), in that order; a status change with no such timestamp is one event
for the new status. Output files written at the end are not events of their own: the
batch's last event names them.
"""

from django.db import migrations

FORWARD = r"""
CREATE OR REPLACE FUNCTION meridian_batches_audit(
    p_action text, p_type text, p_id text, p_repr text, p_tenant bigint, p_changes jsonb
) RETURNS void AS $$
BEGIN
    INSERT INTO core_auditlog (at, actor, action, object_type, object_id, object_repr,
                               tenant_id, changes, reason)
    VALUES (clock_timestamp(),
            left(coalesce(nullif(current_setting('meridian.audit_actor', true), ''),
                          'system:batches'), 150),
            left(p_action, 64), p_type, left(p_id, 64), left(p_repr, 200), p_tenant,
            p_changes, coalesce(current_setting('meridian.audit_reason', true), ''));
END;
$$ LANGUAGE plpgsql;

CREATE OR REPLACE FUNCTION meridian_batchfile_audit() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        PERFORM meridian_batches_audit(
            'file.uploaded', 'batches.batchfile', NEW.id, NEW.id || ' ' || NEW.filename,
            NEW.tenant_id, jsonb_build_object('filename', NEW.filename, 'bytes', NEW.bytes,
                                              'lines', NEW.line_count));
        RETURN NEW;
    END IF;
    PERFORM meridian_batches_audit(
        'file.deleted', 'batches.batchfile', OLD.id, OLD.id || ' ' || OLD.filename,
        OLD.tenant_id, jsonb_build_object('filename', OLD.filename, 'bytes', OLD.bytes,
                                          'purpose', OLD.purpose));
    RETURN OLD;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER batches_batchfile_uploaded
    AFTER INSERT ON batches_batchfile
    FOR EACH ROW WHEN (NEW.purpose = 'batch') EXECUTE FUNCTION meridian_batchfile_audit();
CREATE TRIGGER batches_batchfile_deleted
    AFTER DELETE ON batches_batchfile
    FOR EACH ROW EXECUTE FUNCTION meridian_batchfile_audit();

CREATE OR REPLACE FUNCTION meridian_batch_audit() RETURNS trigger AS $$
DECLARE
    stages text[] := '{}';
    stage text;
    counts jsonb;
    changes jsonb;
BEGIN
    IF TG_OP = 'INSERT' THEN
        PERFORM meridian_batches_audit(
            'batch.created', 'batches.batch', NEW.id, NEW.id || ' (' || NEW.status || ')',
            NEW.tenant_id, jsonb_build_object(
                'status', NEW.status, 'input_file_id', NEW.input_file_id,
                'endpoint', NEW.endpoint, 'model', NEW.model,
                'completion_window', NEW.completion_window,
                'lines', (SELECT line_count FROM batches_batchfile
                          WHERE id = NEW.input_file_id)));
        RETURN NEW;
    ELSIF TG_OP = 'DELETE' THEN
        PERFORM meridian_batches_audit(
            'batch.deleted', 'batches.batch', OLD.id, OLD.id || ' (' || OLD.status || ')',
            OLD.tenant_id, jsonb_build_object('status', OLD.status));
        RETURN OLD;
    END IF;
    IF OLD.in_progress_at IS NULL AND NEW.in_progress_at IS NOT NULL THEN
        stages := stages || 'in_progress'::text; END IF;
    IF OLD.cancelling_at IS NULL AND NEW.cancelling_at IS NOT NULL THEN
        stages := stages || 'cancelling'::text; END IF;
    IF OLD.finalizing_at IS NULL AND NEW.finalizing_at IS NOT NULL THEN
        stages := stages || 'finalizing'::text; END IF;
    IF OLD.completed_at IS NULL AND NEW.completed_at IS NOT NULL THEN
        stages := stages || 'completed'::text; END IF;
    IF OLD.failed_at IS NULL AND NEW.failed_at IS NOT NULL THEN
        stages := stages || 'failed'::text; END IF;
    IF OLD.expired_at IS NULL AND NEW.expired_at IS NOT NULL THEN
        stages := stages || 'expired'::text; END IF;
    IF OLD.cancelled_at IS NULL AND NEW.cancelled_at IS NOT NULL THEN
        stages := stages || 'cancelled'::text; END IF;
    IF NEW.status IS DISTINCT FROM OLD.status AND NOT (NEW.status = ANY (stages)) THEN
        stages := stages || NEW.status::text; END IF;
    IF stages && ARRAY['cancelling', 'finalizing', 'completed', 'failed', 'expired',
                       'cancelled'] THEN
        SELECT jsonb_build_object('total', count(*),
                                  'completed', count(*) FILTER (WHERE state = 'done'),
                                  'failed', count(*) FILTER (WHERE state = 'failed'))
          INTO counts FROM batches_batchline WHERE batch_id = NEW.id;
    END IF;
    FOREACH stage IN ARRAY stages LOOP
        changes := jsonb_build_object('status', jsonb_build_array(OLD.status, NEW.status));
        IF stage <> 'in_progress' THEN
            changes := changes || jsonb_build_object('request_counts', counts);
        END IF;
        IF stage IN ('completed', 'failed', 'expired', 'cancelled') THEN
            changes := changes || jsonb_build_object('output_file_id', NEW.output_file_id,
                                                     'error_file_id', NEW.error_file_id);
        END IF;
        PERFORM meridian_batches_audit(
            'batch.' || stage, 'batches.batch', NEW.id, NEW.id || ' (' || NEW.status || ')',
            NEW.tenant_id, changes);
    END LOOP;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER batches_batch_created_or_deleted
    AFTER INSERT OR DELETE ON batches_batch
    FOR EACH ROW EXECUTE FUNCTION meridian_batch_audit();
CREATE TRIGGER batches_batch_changed
    AFTER UPDATE ON batches_batch
    FOR EACH ROW WHEN (
        OLD.status IS DISTINCT FROM NEW.status
        OR OLD.in_progress_at IS DISTINCT FROM NEW.in_progress_at
        OR OLD.cancelling_at IS DISTINCT FROM NEW.cancelling_at
        OR OLD.finalizing_at IS DISTINCT FROM NEW.finalizing_at
        OR OLD.completed_at IS DISTINCT FROM NEW.completed_at
        OR OLD.failed_at IS DISTINCT FROM NEW.failed_at
        OR OLD.expired_at IS DISTINCT FROM NEW.expired_at
        OR OLD.cancelled_at IS DISTINCT FROM NEW.cancelled_at)
    EXECUTE FUNCTION meridian_batch_audit();
"""

BACKWARD = """
DROP TRIGGER IF EXISTS batches_batch_changed ON batches_batch;
DROP TRIGGER IF EXISTS batches_batch_created_or_deleted ON batches_batch;
DROP FUNCTION IF EXISTS meridian_batch_audit();
DROP TRIGGER IF EXISTS batches_batchfile_deleted ON batches_batchfile;
DROP TRIGGER IF EXISTS batches_batchfile_uploaded ON batches_batchfile;
DROP FUNCTION IF EXISTS meridian_batchfile_audit();
DROP FUNCTION IF EXISTS meridian_batches_audit(text, text, text, text, bigint, jsonb);
"""


class Migration(migrations.Migration):
    dependencies = [("batches", "0002_batch_last_run_at"), ("core", "0002_auditlog_append_only")]
    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
