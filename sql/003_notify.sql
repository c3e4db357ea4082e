-- Wakes a polling relay within milliseconds of a commit: one NOTIFY per inserting statement.
-- NOTIFY is delivered at commit and only for committed transactions, and PostgreSQL folds
-- identical notifications of one transaction into one, so the cost per event is negligible.
-- The relay LISTENs on polling.notify_channel (default "outbox_events") and still polls every
-- polling.poll_interval_ms, so a lost notification only delays, never loses, an event.
CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_ARGV[0], '');
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS outbox_events_notify ON outbox_events;
CREATE TRIGGER outbox_events_notify
    AFTER INSERT ON outbox_events
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify('outbox_events');
