-- What the instances of one relay share beyond the lock or slot that makes one of them the
-- active one (docs/admin.md, "A pause outlives its instance"):
--   - a pause, so a failover or a restart keeps it: the instance that takes over reads this row
--     before it reads any event, and starts paused when it says paused;
--   - where the active instance's admin API answers (admin.advertise_url), so a standby's
--     refusal of an act names it, and the commands follow it.
-- One row per relay: "slot <slot>" in replication mode, "lock <leader_lock_key> <tables>" in
-- polling mode (every instance of one relay shares its configuration, so the same key).
-- Without this table a pause holds only in the instance that was paused (the relay warns once).
CREATE TABLE IF NOT EXISTS outbox_relay_control (
    relay            text        PRIMARY KEY,
    paused_by        text,                 -- NULL: not paused
    paused_reason    text,
    paused_at        timestamptz,
    leader_admin_url text,                 -- the active instance's admin.advertise_url
    leader_instance  text,                 -- its application_name, host and process id
    leader_since     timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now()
);
