-- An example application table, and an order written with its event in ONE transaction.
-- If the transaction rolls back, neither the order nor the event exists; if it commits, the
-- relay publishes the event to topic outbox.event.order with key = the order id.
CREATE TABLE IF NOT EXISTS orders (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer_id text    NOT NULL,
    total_cents bigint  NOT NULL CHECK (total_cents >= 0),
    status      text    NOT NULL DEFAULT 'placed',
    -- the reference the ledger debits under: one debit per payment, whatever redelivers it
    payment_id  uuid    NOT NULL DEFAULT gen_random_uuid() UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- Usage (psql): writes one order and its OrderPlaced event atomically.
--   BEGIN;
--   WITH new_order AS (
--       INSERT INTO orders (customer_id, total_cents) VALUES ('c-42', 1999) RETURNING *
--   )
--   INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers)
--   SELECT 'order', new_order.id::text, 'OrderPlaced',
--          jsonb_build_object('order_id', new_order.id, 'customer_id', new_order.customer_id,
--                             'total_cents', new_order.total_cents),
--          jsonb_build_object('traceparent', '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01')
--   FROM new_order;
--   COMMIT;
CREATE OR REPLACE FUNCTION place_order(customer text, cents bigint) RETURNS bigint
LANGUAGE sql AS $$
    WITH new_order AS (
        INSERT INTO orders (customer_id, total_cents) VALUES (customer, cents) RETURNING *
    ), event AS (
        INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
        SELECT 'order', new_order.id::text, 'OrderPlaced',
               jsonb_build_object('order_id', new_order.id, 'customer_id', new_order.customer_id,
                                  'total_cents', new_order.total_cents)
        FROM new_order
    )
    SELECT id FROM new_order;
$$;
