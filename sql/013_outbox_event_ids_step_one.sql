-- Event ids step by one again: the id trigger of 009_outbox_event_ids.sql keeps the value the
-- identity default has just taken from the sequence, instead of taking a second one.
--
-- 009's trigger gave every new row nextval() whatever the insert said, to close OVERRIDING
-- SYSTEM VALUE (a writer naming the next id, to make a real event look like a duplicate). But
-- the identity default had already called nextval() for the row, so ids went 2, 4, 6, ... and
-- `locate --id 1` found nothing. The trigger cannot see whether the id came from the default
-- or from the insert, so it keeps an id only when it is both:
--   - the value this session's nextval() on the outbox's sequence last returned (currval): the
--     default's, or one the sequence's owner took itself; an id named by a writer is any other
--     number, and gets nextval() as before;
--   - not one this trigger has already let through in this session (kept in the session setting
--     outbox_relay.last_event_id): OVERRIDING SYSTEM VALUE with the id the session's previous
--     insert just got is currval too, and must not be kept twice.
-- So every row still gets a sequence value no other row has, and ids step by one. Nothing else
-- changes: the trigger, its argument (the sequence's OID) and its privileges are 009's. Safe to
-- run again; apply it after 009 (the migrations run in order).
-- Rows already written keep their ids (even ones, on a database that ran 009 alone).
CREATE OR REPLACE FUNCTION outbox_events_assign_id() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $$
DECLARE
    sequence regclass := TG_ARGV[0]::oid::regclass;
    last_given bigint;
    last_kept text := current_setting('outbox_relay.last_event_id', true);
BEGIN
    BEGIN
        last_given := currval(sequence);
    EXCEPTION
        -- no nextval() on it in this session yet: the insert named the id
        WHEN object_not_in_prerequisite_state THEN last_given := NULL;
    END;
    IF last_given IS NULL OR NEW.id IS DISTINCT FROM last_given
       OR last_kept IS NOT DISTINCT FROM last_given::text THEN
        NEW.id := nextval(sequence);
    END IF;
    PERFORM set_config('outbox_relay.last_event_id', NEW.id::text, false);
    RETURN NEW;
END
$$;
REVOKE EXECUTE ON FUNCTION outbox_events_assign_id() FROM PUBLIC;
