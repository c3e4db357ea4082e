-- The ledger consumer's tables (services/ledger): wallets, the inbox, and the ledger.
--
-- One local transaction per event: the inbox row, the debit (or the decline) and the follow-up
-- event in the outbox. A redelivered event hits processed_events' primary key and changes
-- nothing; the consumer commits its Kafka offset only after that transaction commits.
CREATE TABLE IF NOT EXISTS wallets (
    customer_id   text        PRIMARY KEY,
    -- the CHECK is the last line of defence; the debit itself is conditional
    -- (balance_cents >= amount), so a concurrent debit never even tries to overdraw
    balance_cents bigint      NOT NULL CHECK (balance_cents >= 0),
    updated_at    timestamptz NOT NULL DEFAULT now()
);

-- The inbox: one row per event applied (or dead-lettered), keyed by the outbox the event came
-- from (its outbox_relay_source header) and its id there: an id is unique only within one outbox,
-- so an event of another outbox that reuses it is never taken for a duplicate.
-- (A ledger created before the source was part of the key: recreate these two tables.)
CREATE TABLE IF NOT EXISTS processed_events (
    source       text        NOT NULL,
    event_id     text        NOT NULL,
    topic        text        NOT NULL,
    "partition"  integer     NOT NULL,
    "offset"     bigint      NOT NULL,
    outcome      text        NOT NULL CHECK (outcome IN ('debited', 'declined', 'dead_lettered')),
    detail       text,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source, event_id)
);

-- One debit per payment: a second guard, should the same payment ever arrive under a new event id.
CREATE TABLE IF NOT EXISTS ledger_entries (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    payment_id   uuid        NOT NULL UNIQUE,
    order_id     bigint      NOT NULL,
    customer_id  text        NOT NULL REFERENCES wallets,
    amount_cents bigint      NOT NULL CHECK (amount_cents > 0),
    event_source text        NOT NULL,
    event_id     text        NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    FOREIGN KEY (event_source, event_id) REFERENCES processed_events
);

-- The ledger's own outbox (consumer.outbox_table = "ledger_outbox"): its follow-up events apart
-- from the order service's, the relay reading both from one slot ([[outboxes]],
-- docs/outboxes.md). Its columns are the relay's outbox_events' (sql/001_outbox_events.sql,
-- applied first), with ids of its own; not partitioned, and without 003's NOTIFY trigger, 009's
-- id guard and 100's grants (the demo connects as postgres; grant the relay role SELECT and
-- DELETE on it elsewhere). The default consumer.outbox_table writes outbox_events instead.
CREATE TABLE IF NOT EXISTS ledger_outbox (LIKE outbox_events INCLUDING DEFAULTS INCLUDING IDENTITY INCLUDING CONSTRAINTS);
CREATE UNIQUE INDEX IF NOT EXISTS ledger_outbox_id ON ledger_outbox (id);
