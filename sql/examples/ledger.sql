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

-- The inbox: one row per event applied (or dead-lettered), keyed by the record's event id.
CREATE TABLE IF NOT EXISTS processed_events (
    event_id     text        PRIMARY KEY,
    topic        text        NOT NULL,
    "partition"  integer     NOT NULL,
    "offset"     bigint      NOT NULL,
    outcome      text        NOT NULL CHECK (outcome IN ('debited', 'declined', 'dead_lettered')),
    detail       text,
    processed_at timestamptz NOT NULL DEFAULT now()
);

-- One debit per payment: a second guard, should the same payment ever arrive under a new event id.
CREATE TABLE IF NOT EXISTS ledger_entries (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    payment_id   uuid        NOT NULL UNIQUE,
    order_id     bigint      NOT NULL,
    customer_id  text        NOT NULL REFERENCES wallets,
    amount_cents bigint      NOT NULL CHECK (amount_cents > 0),
    event_id     text        NOT NULL REFERENCES processed_events,
    created_at   timestamptz NOT NULL DEFAULT now()
);
