-- The outbox table: applications insert one row per event in the same transaction as their
-- business rows; outbox-relay publishes each committed row to Kafka.
--
-- Range-partitioned by created_at, one partition per UTC day (002_partitions.sql creates them
-- ahead and drops old ones). PostgreSQL requires the partition key in the primary key, so the
-- key is (id, created_at); id alone is still unique because it comes from one sequence.
-- id may also be a uuid: the relay reads it as text.
CREATE TABLE IF NOT EXISTS outbox_events (
    id             bigint GENERATED ALWAYS AS IDENTITY,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb,               -- string entries become Kafka headers (e.g. traceparent)
    topic          text,                -- optional per-row topic, overrides the relay's template
    created_at     timestamptz NOT NULL DEFAULT now(),
    published_at   timestamptz,         -- set by the relay only with polling.after_publish = "mark"
    PRIMARY KEY (id, created_at)
) PARTITION BY RANGE (created_at);

COMMENT ON TABLE outbox_events IS
    'Transactional outbox: written by applications, published to Kafka by outbox-relay';

-- Rows whose day has no partition yet land here instead of failing the application's
-- transaction. Keep it empty by running outbox_create_partitions() daily.
CREATE TABLE IF NOT EXISTS outbox_events_default PARTITION OF outbox_events DEFAULT;

-- Polling claims unpublished rows in id order.
CREATE INDEX IF NOT EXISTS outbox_events_unpublished_idx
    ON outbox_events (id) WHERE published_at IS NULL;
