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

-- Published ids are only ever added: the relay's upsert ORs bits in. An UPDATE that clears one,
-- or moves a block to another table or number, is refused for every role (the owner may still
-- DELETE a block, as above), so a relay role cannot make a published-then-deleted event look
-- like a phantom to `verify` (issue 46). A relay role can still set a bit: see the threat table
-- in docs/security.md. No one needs EXECUTE on the function: a trigger's is checked when the
-- trigger is made.
CREATE OR REPLACE FUNCTION outbox_relay_published_only_adds() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog AS $$
BEGIN
    IF NEW.source_table IS DISTINCT FROM OLD.source_table OR NEW.block IS DISTINCT FROM OLD.block
       OR (NEW.ids & OLD.ids) <> OLD.ids THEN
        RAISE EXCEPTION 'outbox_relay_published: published ids are only ever added (block % of %)',
            OLD.block, OLD.source_table
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'the table''s owner may DELETE a whole block; no role may clear an id';
    END IF;
    RETURN NEW;
END
$$;
REVOKE EXECUTE ON FUNCTION outbox_relay_published_only_adds() FROM PUBLIC;
DROP TRIGGER IF EXISTS outbox_relay_published_only_adds ON outbox_relay_published;
CREATE TRIGGER outbox_relay_published_only_adds BEFORE UPDATE ON outbox_relay_published
    FOR EACH ROW EXECUTE FUNCTION outbox_relay_published_only_adds();
