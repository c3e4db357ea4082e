-- Least-privilege roles for outbox-relay, one per source mode: what each may touch. Run as the
-- owner of the outbox table (or a superuser) after the other migrations; safe to run again after
-- new migrations. The roles are made before, by an administrator (sql/roles.sql), who also sets
-- their passwords out of band, e.g. in psql:  \password outbox_relay
--
-- outbox_relay (replication mode, the default postgres.user):
--   LOGIN, REPLICATION        connect and stream from its slot (on RDS and Aurora: LOGIN and
--                             membership in rds_replication, which grants it there)
--   SELECT on outbox          the first copy of the rows that predate the slot
--   INSERT dead letter        unpublishable events, with their reason (and, with
--                             dead_letter.signing_key_file, the digest replay-dead-letters checks:
--                             INSERT alone cannot make a letter a replay sends, 011_dead_letter_digest.sql)
--   outbox_relay_slots        the relay's memory of its slot (006_relay_slots.sql)
--   outbox_relay_published    the ids it published, for `verify` (010_published.sql)
--   pg_logical_emit_message   its heartbeat (replication.heartbeat_interval_ms)
--   outbox_relay_control      the pause its instances share, the leader's admin URL (015_relay_control.sql)
--   No DELETE or UPDATE on the outbox: replication mode never changes it.
--   REPLICATION lets a role read, through a slot of its own, the changes of every table in any
--   publication of the database: keep publications to the tables they are for.
--
-- outbox_relay_polling (polling mode; set postgres.user = "outbox_relay_polling"):
--   LOGIN                     no REPLICATION: it cannot read any other table's changes
--   SELECT, DELETE on outbox  claim and delete published rows (after_publish = "delete")
--   UPDATE (published_at)     after_publish = "mark"; no other column
--   INSERT dead letter        unpublishable rows are moved there with their reason
--   outbox_relay_published    the ids it published, for `verify` (010_published.sql)
--   outbox_relay_control      the pause its instances share, the leader's admin URL (015_relay_control.sql)
--
-- outbox_relay_verify (`verify`, `verify --watch` and `locate`; set
-- postgres.user = "outbox_relay_verify" in their configuration):
--   LOGIN                     no REPLICATION
--   SELECT only               the outbox, the dead-letter table and outbox_relay_published
--                             (and pg_replication_slots, which any role reads): it compares,
--                             and can change nothing
--
-- None is a superuser, and none can read or write any other table.
-- Replication mode also needs a publication, and creating one needs ownership of the table.
-- Either run `outbox-relay setup` once with the owner's credentials, or create it here:
--   CREATE PUBLICATION outbox_relay FOR TABLE outbox_events
--       WITH (publish = 'insert', publish_via_partition_root = true);
-- RDS and Aurora: no customer role (rds_superuser included) may create a role with REPLICATION;
-- replication is granted by membership in rds_replication instead. That path is taken where the
-- role rds_replication exists and this session is not a superuser (on RDS the master user never
-- is), so a self-managed server where a superuser runs this keeps the attribute.
-- The roles themselves are made by sql/roles.sql, which an administrator runs before the
-- migrations (roles belong to the server, and making them takes CREATEROLE, and REPLICATION or a
-- superuser, which the table's owner need not have). A role missing here is made only when this
-- session may (a superuser applying every file, as before); otherwise the file stops, naming
-- sql/roles.sql. A role that exists is left as it is.
-- One session at a time makes and grants the roles (they are the server's: two databases
-- migrated at once would race), and this comes first: applied as one transaction (one
-- multi-statement query), a session that waited here then looks the roles up afresh. Taken only
-- inside a block below, the wait came after a first look at the catalog, and the role the other
-- session had just made could stay invisible to a GRANT ("role ... does not exist").
SELECT pg_advisory_xact_lock(hashtext('outbox-relay roles'));

DO $$
DECLARE
    rds boolean := EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'rds_replication')
                   AND NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user);
    role text;
BEGIN
    -- one session at a time makes the roles (they are the server's: migrations of two
    -- databases at once would otherwise race to make the same one)
    PERFORM pg_advisory_xact_lock(hashtext('outbox-relay roles'));
    FOREACH role IN ARRAY ARRAY['outbox_relay', 'outbox_relay_polling', 'outbox_relay_verify'] LOOP
        CONTINUE WHEN EXISTS (SELECT 1 FROM pg_roles WHERE rolname = role);
        BEGIN
            IF role <> 'outbox_relay' THEN
                EXECUTE format('CREATE ROLE %I LOGIN', role);
            ELSIF rds THEN
                CREATE ROLE outbox_relay LOGIN;
                GRANT rds_replication TO outbox_relay;
            ELSE
                CREATE ROLE outbox_relay LOGIN REPLICATION;
            END IF;
        EXCEPTION
            -- made meanwhile (roles are server-wide: another database's session may have)
            WHEN duplicate_object OR unique_violation THEN NULL;
            WHEN insufficient_privilege OR object_not_in_prerequisite_state THEN
                RAISE EXCEPTION 'role % does not exist, and role % may not create it: %', role, current_user, SQLERRM
                    USING HINT = 'an administrator runs sql/roles.sql first (README, First deployment, step 1)';
        END;
    END LOOP;
END
$$;

GRANT USAGE ON SCHEMA public TO outbox_relay, outbox_relay_polling, outbox_relay_verify;

-- replication (older versions of this file granted it DELETE and UPDATE: taken back)
REVOKE DELETE, UPDATE ON outbox_events FROM outbox_relay;
GRANT SELECT ON outbox_events TO outbox_relay;
GRANT SELECT, INSERT ON outbox_dead_letter TO outbox_relay;
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_relay_slots TO outbox_relay;
GRANT SELECT, INSERT, UPDATE ON outbox_relay_published TO outbox_relay, outbox_relay_polling;
DO $$
DECLARE
    f regprocedure;
BEGIN
    -- (only where the relay lacks it: sql/roles.sql, run by an administrator, grants it too)
    FOR f IN SELECT oid::regprocedure FROM pg_proc WHERE proname = 'pg_logical_emit_message' LOOP
        CONTINUE WHEN has_function_privilege('outbox_relay', f, 'EXECUTE');
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO outbox_relay', f);
        IF NOT has_function_privilege('outbox_relay', f, 'EXECUTE') THEN
            RAISE insufficient_privilege;
        END IF;
    END LOOP;
EXCEPTION
    WHEN insufficient_privilege THEN
        RAISE WARNING 'cannot grant EXECUTE on pg_logical_emit_message to outbox_relay: set replication.heartbeat_interval_ms = 0 or have an administrator run sql/roles.sql (a superuser grants it)';
END
$$;

-- polling
GRANT SELECT, DELETE ON outbox_events TO outbox_relay_polling;
GRANT UPDATE (published_at) ON outbox_events TO outbox_relay_polling;
GRANT SELECT, INSERT ON outbox_dead_letter TO outbox_relay_polling;

-- both: the signal table's requests (014_relay_signal.sql): read them, and write only what
-- became of each (never a request: INSERT is outbox_relay_operator's alone)
GRANT SELECT, UPDATE (started_at, started_by, executor_pid, finished_at, result, receipt)
    ON outbox_relay_signal TO outbox_relay, outbox_relay_polling;

-- both: the pause and the leader's address the instances of one relay share (015_relay_control.sql)
GRANT SELECT, INSERT, UPDATE ON outbox_relay_control TO outbox_relay, outbox_relay_polling;

-- verify: reads, nothing more
GRANT SELECT ON outbox_events, outbox_dead_letter, outbox_relay_published TO outbox_relay_verify;
