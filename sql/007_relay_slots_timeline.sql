-- The timeline each slot was created on, so a relay that finds its slot missing can tell a
-- failover (the server is a promoted standby, on a later timeline, without a copy of the slot:
-- fatal `failover_without_slot`) from a slot dropped by hand (fatal `slot_missing`).
ALTER TABLE outbox_relay_slots ADD COLUMN IF NOT EXISTS created_timeline integer;
