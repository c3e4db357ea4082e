-- A table-less outbox for replication mode: outbox_emit() writes the event only to the WAL,
-- as a transactional logical decoding message (pg_logical_emit_message(true, ...)). It is
-- decoded at commit and never if the transaction rolls back, exactly like an outbox row, and it
-- leaves no row to clean up. The relay publishes it with the same record mapping as a row.
--
--   BEGIN;
--   UPDATE orders SET status = 'paid' WHERE id = 42;
--   SELECT outbox_emit('order', '42', 'OrderPaid', '{"order_id": 42}');
--   COMMIT;
--
-- Polling mode cannot see these events: use it only with source.mode = "replication".
-- The prefix is pinned to 'outbox' (the relay's replication.message_prefix default) inside the
-- function: the `prefix` argument is kept for existing callers and must be 'outbox'. (Running as
-- its owner, the function would otherwise write messages under any prefix a caller names, for
-- whatever else reads the WAL.) A relay configured with another prefix needs this file edited
-- to match.
-- Size: an event over 1,000,000 bytes (payload and headers as text; Kafka's default
-- message.max.bytes is about 1 MB) is refused here, in the writer's transaction, rather than
-- reach the WAL and be dead-lettered by the relay. Raise it together with the broker's limit.
--
-- Who may emit: the relay publishes a transactional message with its prefix to the topic the
-- message names, so emitting is a privilege. outbox_emit() runs as its owner (SECURITY
-- DEFINER); EXECUTE on it is revoked from PUBLIC and granted to the NOLOGIN role outbox_writer,
-- which you grant to the application's role:  GRANT outbox_writer TO app;
-- EXECUTE on pg_logical_emit_message is revoked from PUBLIC too (a superuser must run this file
-- for that part; otherwise a WARNING says so and `outbox-relay check` warns until it is done).
-- Non-transactional messages with the prefix are never published (they are written even when
-- their transaction rolls back); the relay dead-letters them.
CREATE OR REPLACE FUNCTION outbox_emit(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    headers        jsonb DEFAULT NULL,
    topic          text  DEFAULT NULL,
    prefix         text  DEFAULT 'outbox'
) RETURNS uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    event_id uuid := gen_random_uuid();
BEGIN
    IF aggregate_type IS NULL OR aggregate_id IS NULL OR event_type IS NULL OR payload IS NULL THEN
        RAISE EXCEPTION 'outbox_emit: aggregate_type, aggregate_id, event_type and payload must not be NULL';
    END IF;
    IF prefix IS DISTINCT FROM 'outbox' THEN
        RAISE EXCEPTION 'outbox_emit: prefix % is not allowed: the prefix is pinned to ''outbox'' (edit sql/005_outbox_emit.sql to match replication.message_prefix)', quote_literal(prefix);
    END IF;
    IF octet_length(payload::text) + coalesce(octet_length(headers::text), 0) > 1000000 THEN
        RAISE EXCEPTION 'outbox_emit: event of % bytes (payload and headers), more than 1000000: Kafka would refuse it; store large data elsewhere and send a reference',
            octet_length(payload::text) + coalesce(octet_length(headers::text), 0);
    END IF;
    -- payload and headers travel as their jsonb text, so the Kafka value is byte-identical to
    -- the same event written to outbox_events.
    PERFORM pg_logical_emit_message(true, prefix, json_build_object(
        'id', event_id::text,
        'aggregate_type', aggregate_type,
        'aggregate_id', aggregate_id,
        'event_type', event_type,
        'payload', payload::text,
        'headers', headers::text,
        'topic', topic)::text);
    RETURN event_id;
END
$$;

-- outbox_writer is made by sql/roles.sql, which an administrator runs before the migrations;
-- it is made here only when missing and this session may (a superuser applying every file).
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_writer') THEN
        CREATE ROLE outbox_writer NOLOGIN;
    END IF;
EXCEPTION
    WHEN duplicate_object OR unique_violation THEN NULL;
    WHEN insufficient_privilege THEN
        RAISE EXCEPTION 'role outbox_writer does not exist, and role % may not create it', current_user
            USING HINT = 'an administrator runs sql/roles.sql first (README, First deployment, step 1)';
END
$$;
REVOKE EXECUTE ON FUNCTION outbox_emit(text, text, text, jsonb, jsonb, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_emit(text, text, text, jsonb, jsonb, text, text) TO outbox_writer;

DO $$
DECLARE
    f regprocedure;
BEGIN
    -- (only where PUBLIC still holds it: sql/roles.sql, run by an administrator, revokes it too)
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p WHERE p.proname = 'pg_logical_emit_message'
             AND (p.proacl IS NULL OR EXISTS (SELECT 1 FROM aclexplode(p.proacl) a WHERE a.grantee = 0)) LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
        IF has_function_privilege('public', f, 'EXECUTE') THEN
            RAISE insufficient_privilege;
        END IF;
    END LOOP;
EXCEPTION
    WHEN insufficient_privilege THEN
        RAISE WARNING 'cannot revoke EXECUTE on pg_logical_emit_message from PUBLIC (needs a superuser: sql/roles.sql does it): any login can emit outbox messages until it is done';
END
$$;
