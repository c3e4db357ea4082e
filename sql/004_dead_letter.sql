-- Events the relay could not publish (NULL aggregate id, payload over the broker's size limit,
-- unknown topic with auto-create off), moved here with the reason in the same transaction that
-- removes them from the outbox, so nothing is lost and nothing is skipped silently.
-- row_data has one shape in both modes: the event's columns as text, keyed by the default column
-- names (id, aggregate_type, aggregate_id, event_type, payload, headers, topic).
-- Replay one after fixing its cause:
--   INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers, topic)
--   SELECT row_data->>'aggregate_type', row_data->>'aggregate_id', row_data->>'event_type',
--          (row_data->>'payload')::jsonb, (row_data->>'headers')::jsonb, row_data->>'topic'
--   FROM outbox_dead_letter WHERE id = ...;
--   DELETE FROM outbox_dead_letter WHERE id = ...;
CREATE TABLE IF NOT EXISTS outbox_dead_letter (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source_table     text        NOT NULL,   -- schema.table the row came from
    event_id         text        NOT NULL,   -- the row's id, as text
    row_data         jsonb       NOT NULL,   -- the event's columns as text (see above)
    reason           text        NOT NULL,
    dead_lettered_at timestamptz NOT NULL DEFAULT now()
);
