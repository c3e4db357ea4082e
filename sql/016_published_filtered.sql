-- The ids the outbox's transforms filtered out (docs/transforms.md), beside the published ones in
-- the same blocks: bit i of `filtered` is set once the event with id block*8192+i was settled
-- without a record because a rule filtered it (polling: in the transaction that releases its row;
-- replication: before the slot confirms past it). `verify` then counts such a row `filtered`
-- even after the rules change, never `missing`. NULL: none filtered in the block. An older relay
-- leaves it alone (it writes `ids` only).
ALTER TABLE outbox_relay_published ADD COLUMN IF NOT EXISTS filtered bit(8192);

-- 010's function, with the filtered ids only ever added too.
CREATE OR REPLACE FUNCTION outbox_relay_published_only_adds() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog AS $$
BEGIN
    IF NEW.source_table IS DISTINCT FROM OLD.source_table OR NEW.block IS DISTINCT FROM OLD.block
       OR (NEW.ids & OLD.ids) <> OLD.ids
       OR (OLD.filtered IS NOT NULL AND (NEW.filtered IS NULL OR (NEW.filtered & OLD.filtered) <> OLD.filtered)) THEN
        RAISE EXCEPTION 'outbox_relay_published: published ids are only ever added, and filtered ones (block % of %)',
            OLD.block, OLD.source_table
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'the table''s owner may DELETE a whole block; no role may clear an id';
    END IF;
    RETURN NEW;
END
$$;
REVOKE EXECUTE ON FUNCTION outbox_relay_published_only_adds() FROM PUBLIC;
