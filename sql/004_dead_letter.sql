-- Events the relay could not publish (NULL aggregate id, payload over the broker's size limit,
-- unknown topic with auto-create off), moved here with the reason in the same transaction that
-- removes them from the outbox, so nothing is lost and nothing is skipped silently.
-- row_data has one shape in both modes: the event's columns as text, keyed by the default column
-- names (id, aggregate_type, aggregate_id, event_type, payload, headers, topic).
-- Replay after fixing the cause (the topic, the size limit, or the data in row_data: the letter is
-- what is replayed, not the outbox row), as the outbox's owner:
--   outbox-relay replay-dead-letters --config owner.toml [--ids 42,43] [--dry-run]
-- It publishes each letter under its event's own id, and removes the letter and the event's row
-- in one transaction once Kafka acknowledged it (docs/polling.md, "Replaying dead letters"). Do not
-- re-insert a letter into the outbox by hand: it would be published under a new id, and verify
-- would find the old one missing.
CREATE TABLE IF NOT EXISTS outbox_dead_letter (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source_table     text        NOT NULL,   -- schema.table the row came from
    event_id         text        NOT NULL,   -- the row's id, as text
    row_data         jsonb       NOT NULL,   -- the event's columns as text (see above)
    reason           text        NOT NULL,
    dead_lettered_at timestamptz NOT NULL DEFAULT now()
);
-- verify, status and the relay's gauge look letters up by outbox and event id
CREATE INDEX IF NOT EXISTS outbox_dead_letter_source_event ON outbox_dead_letter (source_table, event_id);
