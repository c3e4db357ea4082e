-- An outbox table laid out the way Debezium's outbox event router expects. outbox-relay reads
-- it with only column names changed in its configuration:
--   [outbox]
--   table = "outboxevent"
--   [outbox.columns]
--   id = "id"
--   aggregate_type = "aggregatetype"
--   aggregate_id = "aggregateid"
--   event_type = "type"
--   payload = "payload"
--   headers = ""
--   topic = ""
--   created_at = ""
CREATE TABLE IF NOT EXISTS outboxevent (
    id            uuid  PRIMARY KEY,
    aggregatetype text  NOT NULL,
    aggregateid   text  NOT NULL,
    type          text  NOT NULL,
    payload       jsonb NOT NULL
);
