-- The outbox table each slot was made for (schema.table), so a polling relay that finds a slot
-- the relay created under another name can tell its own outbox's (a switch from replication mode
-- not finished: each topic is read back whole, the slot reported until it is dropped) from
-- another outbox's relay's, which is none of its business. NULL for slots made before this.
ALTER TABLE outbox_relay_slots ADD COLUMN IF NOT EXISTS outbox_table text;
