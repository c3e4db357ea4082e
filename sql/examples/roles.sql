-- Least-privilege roles for the example services. Run as the owner of their tables (or a
-- superuser) after orders.sql, idempotency.sql and ledger.sql; safe to run again. Then give each
-- role a password out of band (psql: \password orders_service) and set postgres.user.
--
-- orders_service (services/orders):
--   idempotency_keys   SELECT, INSERT, UPDATE, DELETE   claim, take over, complete, expire keys
--   idempotency_lease_tokens  USAGE                     a new lease token per claim and takeover
--   orders             INSERT, SELECT                   write an order and read back its id
--   outbox_events      INSERT (the event's columns)     the OrderPlaced event, nothing else
-- ledger_service (services/ledger):
--   processed_events   SELECT, INSERT, UPDATE           the inbox (UPDATE: a replayed dead letter)
--   wallets            SELECT, UPDATE                   the conditional debit; it cannot create money
--   ledger_entries     INSERT                           one row per debit
--   outbox_events      INSERT (the event's columns)     PaymentCompleted / PaymentDeclined
-- Neither may read the other's tables, delete an order or a ledger row, or read the outbox.
DO $$
BEGIN
    CREATE ROLE orders_service LOGIN;
EXCEPTION
    WHEN duplicate_object OR unique_violation THEN NULL;
END
$$;
DO $$
BEGIN
    CREATE ROLE ledger_service LOGIN;
EXCEPTION
    WHEN duplicate_object OR unique_violation THEN NULL;
END
$$;

GRANT USAGE ON SCHEMA public TO orders_service, ledger_service;

GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency_keys TO orders_service;
GRANT USAGE ON SEQUENCE idempotency_lease_tokens TO orders_service;
GRANT SELECT, INSERT ON orders TO orders_service;
-- the event's columns only: never id (its sequence's, sql/009_outbox_event_ids.sql), created_at
-- (the partition it lands in) or published_at (the relay's)
REVOKE INSERT ON outbox_events FROM orders_service, ledger_service;
GRANT INSERT (aggregate_type, aggregate_id, event_type, payload, headers)
    ON outbox_events TO orders_service, ledger_service;

GRANT SELECT, INSERT, UPDATE ON processed_events TO ledger_service;
GRANT SELECT, UPDATE ON wallets TO ledger_service;
GRANT INSERT ON ledger_entries TO ledger_service;
