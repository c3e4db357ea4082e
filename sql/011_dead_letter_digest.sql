-- Signed dead letters (issue 46, N3). Both relay roles may INSERT into outbox_dead_letter (they
-- write the letters), and `replay-dead-letters` publishes a letter under its event's id, deletes
-- that event's row and records the id as published. With dead_letter.signing_key_file set, the
-- relay writes each letter with `digest`: HMAC-SHA256, under a key only the relay and the
-- operator hold, of its outbox, event id and row_data. replay-dead-letters sends only letters
-- whose digest its key verifies, or that the operator vouches for by id (--vouch), and refuses
-- the rest, naming each: a letter anyone else inserted, or one edited since (docs/polling.md,
-- "Replaying dead letters"). The column says nothing by itself: anyone may write any text here;
-- only the key makes it mean something.
ALTER TABLE outbox_dead_letter ADD COLUMN IF NOT EXISTS digest text;
