-- What the replication relay remembers about its slots, so it can tell "first start" from
-- "the slot I published from has disappeared" (a fatal error, never a silent recreate), and an
-- interrupted first copy of pre-existing rows from a finished one.
CREATE TABLE IF NOT EXISTS outbox_relay_slots (
    slot_name             text        PRIMARY KEY,
    created_lsn           pg_lsn      NOT NULL,   -- the slot's consistent point
    created_at            timestamptz NOT NULL DEFAULT now(),
    snapshot_completed_at timestamptz             -- rows that predate the slot are published
);
