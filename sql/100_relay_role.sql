-- A least-privilege role for outbox-relay. Run as the owner of the outbox table (or a
-- superuser) after the other migrations; safe to run again after new migrations.
-- Then give it a password out of band, e.g. in psql:  \password outbox_relay
--
-- What the role may do, and why:
--   LOGIN, REPLICATION   connect and, in replication mode, stream from its slot
--   SELECT on outbox     polling reads rows; replication copies the rows that predate the slot
--   DELETE on outbox     polling with after_publish = "delete", and moving rows to dead letter
--   UPDATE (published_at) polling with after_publish = "mark"
--   INSERT dead letter   unpublishable rows are moved there with their reason
--   outbox_relay_slots   the replication relay's memory of its slot (006_relay_slots.sql)
-- It is not a superuser and cannot read or write any other table.
-- Replication mode also needs a publication, and creating one needs ownership of the table.
-- Either run `outbox-relay setup` once with the owner's credentials, or create it here:
--   CREATE PUBLICATION outbox_relay FOR TABLE outbox_events
--       WITH (publish = 'insert', publish_via_partition_root = true);
DO $$
BEGIN
    CREATE ROLE outbox_relay LOGIN REPLICATION;
EXCEPTION
    -- already there (roles are cluster-wide: another database may have created it)
    WHEN duplicate_object OR unique_violation THEN NULL;
END
$$;

GRANT USAGE ON SCHEMA public TO outbox_relay;
GRANT SELECT, DELETE ON outbox_events TO outbox_relay;
GRANT UPDATE (published_at) ON outbox_events TO outbox_relay;
GRANT SELECT, INSERT ON outbox_dead_letter TO outbox_relay;
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_relay_slots TO outbox_relay;
-- the relay's heartbeat (replication.heartbeat_interval_ms) is a logical decoding message
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT oid::regprocedure FROM pg_proc WHERE proname = 'pg_logical_emit_message' LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO outbox_relay', f);
    END LOOP;
EXCEPTION
    WHEN insufficient_privilege THEN
        RAISE WARNING 'cannot grant EXECUTE on pg_logical_emit_message to outbox_relay: set replication.heartbeat_interval_ms = 0 or grant it as a superuser';
END
$$;
