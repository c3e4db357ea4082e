-- Event ids come from the outbox's sequence, never from a writer.
--
-- The primary key is (id, created_at) (the partition key must be in it), so it does not stop a
-- row that reuses a real event's id under another created_at, and any role with INSERT may
-- write `OVERRIDING SYSTEM VALUE` with an id of its choice: the next one, to make the real event
-- look like a duplicate to a consumer that keys its inbox on the id. This trigger gives every
-- new row the sequence's next value, whatever the insert said, for every role, the table owner's
-- included. (A plain insert naming id is refused by the identity column already; the trigger
-- closes OVERRIDING SYSTEM VALUE.) sql/examples/roles.sql also grants writers INSERT on
-- the event's columns only.
--
-- Cost: one more nextval per row (the identity default's value is replaced, so ids advance by
-- two) and a PL/pgSQL call. An import that must keep its ids (a migration from another outbox)
-- disables the trigger as the table owner inside one transaction. DISABLE TRIGGER applies to
-- every session once committed and locks the table against writers meanwhile, so never run it
-- on its own (in autocommit, or without the ENABLE):
--   BEGIN;
--   ALTER TABLE outbox_events DISABLE TRIGGER outbox_events_assign_id;
--   INSERT INTO outbox_events (id, ...) OVERRIDING SYSTEM VALUE ...;
--   ALTER TABLE outbox_events ENABLE TRIGGER outbox_events_assign_id;
--   COMMIT;
-- (SECURITY DEFINER: a writer needs no privilege on the sequence, as with the identity default;
-- the trigger's argument is the sequence's OID, which a rename or a move to another schema keeps)
CREATE OR REPLACE FUNCTION outbox_events_assign_id() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $$
BEGIN
    NEW.id := nextval(TG_ARGV[0]::oid::regclass);
    RETURN NEW;
END
$$;
-- No one needs EXECUTE on it: a trigger's function is checked when the trigger is created (by
-- this file, as the owner), not when it fires. Granted to PUBLIC, any login owning a table could
-- attach it to that table with the OID of any sequence and take values of it as the function's
-- owner (issue 46).
REVOKE EXECUTE ON FUNCTION outbox_events_assign_id() FROM PUBLIC;

DO $$
DECLARE
    sequence text := pg_get_serial_sequence('outbox_events', 'id');
BEGIN
    IF sequence IS NULL THEN
        RAISE NOTICE 'outbox_events.id has no sequence (a uuid id?): no id trigger';
        RETURN;
    END IF;
    EXECUTE 'DROP TRIGGER IF EXISTS outbox_events_assign_id ON outbox_events';
    EXECUTE format(
        'CREATE TRIGGER outbox_events_assign_id BEFORE INSERT ON outbox_events '
        'FOR EACH ROW EXECUTE FUNCTION outbox_events_assign_id(%L)', sequence::regclass::oid);
END
$$;
