-- Daily partition maintenance for the outbox table. Run both functions daily (pg_cron, a
-- Kubernetes CronJob running psql, or your scheduler):
--   SELECT outbox_create_partitions(7);            -- today and the next 7 UTC days
--   SELECT outbox_drop_partitions(interval '7 days');
-- Partitions are named <table>_pYYYYMMDD and cover one UTC day.

CREATE OR REPLACE FUNCTION outbox_create_partitions(
    days_ahead integer DEFAULT 7,
    parent     text    DEFAULT 'outbox_events'
) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    today   date := (now() AT TIME ZONE 'UTC')::date;
    day     date;
    name    text;
    created integer := 0;
BEGIN
    IF days_ahead < 0 THEN
        RAISE EXCEPTION 'outbox_create_partitions: days_ahead must be >= 0, got %', days_ahead;
    END IF;
    FOR offset_days IN 0..days_ahead LOOP
        day  := today + offset_days;
        name := format('%s_p%s', parent, to_char(day, 'YYYYMMDD'));
        IF to_regclass(quote_ident(name)) IS NULL THEN
            EXECUTE format(
                'CREATE TABLE %I PARTITION OF %I FOR VALUES FROM (%L) TO (%L)',
                name, parent, day::text || ' 00:00:00+00', (day + 1)::text || ' 00:00:00+00');
            created := created + 1;
        END IF;
    END LOOP;
    RETURN created;
END
$$;

-- Drops the daily partitions whose whole day is older than `retention`.
--
-- A partition that still holds rows the relay has not published is kept, with a WARNING,
-- unless `force` is true:
--   * polling mode with after_publish = "delete": a leftover row is an unpublished event;
--   * polling mode with "mark": rows with published_at IS NULL are unpublished;
--   * replication mode: rows are published from the WAL as they are inserted, so rows left in
--     the table are already delivered once the slot has confirmed past them; call with
--     force => true (check outbox_relay_slot_confirmed_lag_bytes first).
CREATE OR REPLACE FUNCTION outbox_drop_partitions(
    retention interval DEFAULT interval '7 days',
    parent    text     DEFAULT 'outbox_events',
    force     boolean  DEFAULT false
) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    cutoff  date := ((now() - retention) AT TIME ZONE 'UTC')::date;
    part    record;
    pending boolean;
    dropped integer := 0;
BEGIN
    FOR part IN
        SELECT c.relname AS name,
               to_date(substring(c.relname FROM '_p([0-9]{8})$'), 'YYYYMMDD') AS day
        FROM pg_inherits i
        JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = to_regclass(quote_ident(parent))
          AND c.relname ~ '_p[0-9]{8}$'
        ORDER BY c.relname
    LOOP
        CONTINUE WHEN part.day >= cutoff;
        IF NOT force THEN
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I WHERE published_at IS NULL)', part.name)
                INTO pending;
            IF pending THEN
                RAISE WARNING 'outbox_drop_partitions: kept % because it holds unpublished rows (pass force => true to drop it anyway)', part.name;
                CONTINUE;
            END IF;
        END IF;
        EXECUTE format('DROP TABLE %I', part.name);
        dropped := dropped + 1;
    END LOOP;
    RETURN dropped;
END
$$;

SELECT outbox_create_partitions(7);
