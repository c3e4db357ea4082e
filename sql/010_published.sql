-- What the relay published, one bit per event id: the record `verify` needs once rows are
-- deleted on purpose (polling.after_publish = "delete", the insert+delete style, a dropped
-- partition, a replayed dead letter). Without it a record in Kafka whose row is gone cannot be
-- told from a phantom (a record no committed row ever had), and a row deleted unpublished
-- cannot be told from one published and cleaned up.
--
-- Block b of a source table holds the ids b*8192 .. b*8192+8191: bit i (from the left) is set
-- once the event with id b*8192+i was acknowledged by Kafka (polling: in the transaction that
-- releases the row; replication: before the slot confirms past it). 1 KiB per 8,192 ids, so
-- 128 KiB per million ids, whatever the events' size; ids that are not numbers are not recorded.
-- `topics` tells verify which topics to read when no row is left to say it.
-- Nothing prunes it: past Kafka's retention a block only costs its kilobyte; to drop old ones:
--   DELETE FROM outbox_relay_published WHERE last_published_at < now() - interval '35 days';
CREATE TABLE IF NOT EXISTS outbox_relay_published (
    source_table       text        NOT NULL,   -- schema.table, as in outbox_dead_letter
    block              bigint      NOT NULL,   -- id / 8192
    ids                bit(8192)   NOT NULL,
    topics             text[]      NOT NULL,   -- the topics the block's events went to (at most)
    first_published_at timestamptz NOT NULL DEFAULT now(),
    last_published_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source_table, block)
);
