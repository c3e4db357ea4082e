-- Signed outbox_emit() messages (issue 46, N1). The relay publishes a transactional logical
-- decoding message with the 'outbox' prefix under the event id its content names. Where the
-- REVOKE of sql/005_outbox_emit.sql cannot run (a managed PostgreSQL without a superuser), any login may call
-- pg_logical_emit_message(true, 'outbox', ...) and name a real event's id: its forged event,
-- published first, makes a consumer that deduplicates by id skip the real one.
--
-- With a key installed here, outbox_emit() signs each message: HMAC-SHA256 under the key, over
-- a domain tag and the event's seven fields (each a presence byte, its length as 8 bytes
-- big-endian, its UTF-8 bytes), written as the message's "digest" (lowercase hex). A relay with
-- replication.message_signing_key_file (the same key, in a file) publishes only messages whose
-- digest its key verifies; any other message with the prefix is dead-lettered, unsigned (so
-- replay-dead-letters does not send it unless vouched for), and never published.
-- The key is readable by this file's role alone (the owner of outbox_emit(), which runs as its
-- owner): not by the application, not by the relay's roles. Install it, as that role:
--   openssl rand -hex 32 > emit.key      (give the same file to the relay)
--   psql -v key="$(cat emit.key)" <<'SQL'
--   INSERT INTO outbox_emit_key (key) VALUES (:'key')
--       ON CONFLICT (singleton) DO UPDATE SET key = EXCLUDED.key;
--   SQL
-- Without a key here outbox_emit() writes unsigned messages, as before: a relay without
-- replication.message_signing_key_file publishes them; one with it dead-letters them.
-- Order of an upgrade (docs/upgrading.md): apply this file, install the key, then give the
-- relay the key file and restart it.
-- Cost: two sha256() calls and a 64-step loop per event, in the writer's transaction.
-- (sha256() is built in since PostgreSQL 11; pgcrypto is not needed.)
CREATE TABLE IF NOT EXISTS outbox_emit_key (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    -- the key file's text less trailing whitespace, as the relay reads it
    key       text    NOT NULL CHECK (octet_length(key) >= 32 AND key = rtrim(key, E' \t\n\r\f'))
);
REVOKE ALL ON TABLE outbox_emit_key FROM PUBLIC;

-- The function reads the key table by its qualified name (its search_path holds pg_catalog and
-- pg_temp only, as a SECURITY DEFINER function's must): the name is filled in here.
DO $outer$
BEGIN
    EXECUTE replace($create$
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
    event_id     uuid := gen_random_uuid();
    payload_text text := payload::text;
    headers_text text := headers::text;
    emit_key     bytea;
    inner_pad    bytea;
    outer_pad    bytea;
    signed       bytea;
    part         bytea;
    digest       text;
BEGIN
    IF aggregate_type IS NULL OR aggregate_id IS NULL OR event_type IS NULL OR payload IS NULL THEN
        RAISE EXCEPTION 'outbox_emit: aggregate_type, aggregate_id, event_type and payload must not be NULL';
    END IF;
    IF prefix IS DISTINCT FROM 'outbox' THEN
        RAISE EXCEPTION 'outbox_emit: prefix % is not allowed: the prefix is pinned to ''outbox'' (edit sql/005_outbox_emit.sql to match replication.message_prefix)', quote_literal(prefix);
    END IF;
    IF octet_length(payload_text) + coalesce(octet_length(headers_text), 0) > 1000000 THEN
        RAISE EXCEPTION 'outbox_emit: event of % bytes (payload and headers), more than 1000000: Kafka would refuse it; store large data elsewhere and send a reference',
            octet_length(payload_text) + coalesce(octet_length(headers_text), 0);
    END IF;
    SELECT convert_to(k.key, 'UTF8') INTO emit_key FROM @key_table@ k;
    IF emit_key IS NOT NULL THEN
        -- HMAC-SHA256 (RFC 2104): a key over 64 bytes is hashed first, then zero-padded to 64
        IF octet_length(emit_key) > 64 THEN
            emit_key := sha256(emit_key);
        END IF;
        emit_key := emit_key || decode(repeat('00', 64 - octet_length(emit_key)), 'hex');
        inner_pad := emit_key;
        outer_pad := emit_key;
        FOR i IN 0..63 LOOP
            inner_pad := set_byte(inner_pad, i, get_byte(emit_key, i) # 54);
            outer_pad := set_byte(outer_pad, i, get_byte(emit_key, i) # 92);
        END LOOP;
        signed := convert_to('outbox-relay emitted event v1', 'UTF8');
        FOREACH part IN ARRAY ARRAY[
            convert_to(event_id::text, 'UTF8'), convert_to(aggregate_type, 'UTF8'),
            convert_to(aggregate_id, 'UTF8'), convert_to(event_type, 'UTF8'),
            convert_to(payload_text, 'UTF8'), convert_to(headers_text, 'UTF8'), convert_to(topic, 'UTF8')]
        LOOP
            IF part IS NULL THEN
                signed := signed || '\x00'::bytea;
            ELSE
                signed := signed || '\x01'::bytea || int8send(octet_length(part)::bigint) || part;
            END IF;
        END LOOP;
        digest := encode(sha256(outer_pad || sha256(inner_pad || signed)), 'hex');
    END IF;
    -- payload and headers travel as their jsonb text, so the Kafka value is byte-identical to
    -- the same event written to outbox_events.
    PERFORM pg_logical_emit_message(true, prefix, json_build_object(
        'id', event_id::text,
        'aggregate_type', aggregate_type,
        'aggregate_id', aggregate_id,
        'event_type', event_type,
        'payload', payload_text,
        'headers', headers_text,
        'topic', topic,
        'digest', digest)::text);
    RETURN event_id;
END
$$
$create$, '@key_table@', format('%I.outbox_emit_key', current_schema()));
END
$outer$;

-- CREATE OR REPLACE keeps the grants of sql/005_outbox_emit.sql; repeated for a database that lacks them.
REVOKE EXECUTE ON FUNCTION outbox_emit(text, text, text, jsonb, jsonb, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_emit(text, text, text, jsonb, jsonb, text, text) TO outbox_writer;
