-- The order service's Idempotency-Key store (services/orders). Apply after orders.sql.
--
-- A key belongs to its caller (the bearer token's subject): the PRIMARY KEY is (caller, key), so
-- the same key sent by two callers names two requests. That PRIMARY KEY is the arbiter between
-- concurrent requests and replicas: whoever inserts the key owns the request; everyone else
-- reads the row. A row is
--   in_progress  owned by the worker holding lease_token until lease_expires_at; after that any
--                replica may take it over (a new lease_token from idempotency_lease_tokens), and
--                the old worker's final write is refused because it checks its token (fencing);
--   completed    the response is stored and every retry with the same key gets it back;
--   failed       the request failed before doing anything (a transient error): the next retry
--                takes it over at once instead of waiting for the lease.
-- Rows expire (expires_at) and idempotency_keys_cleanup() deletes them; a key reused after that
-- is a new request.
CREATE TABLE IF NOT EXISTS idempotency_keys (
    caller           text        NOT NULL CHECK (length(caller) BETWEEN 1 AND 255),
    key              text        NOT NULL CHECK (length(key) BETWEEN 1 AND 255),
    fingerprint      bytea       NOT NULL,  -- SHA-256 of method, path and the canonical body
    state            text        NOT NULL CHECK (state IN ('in_progress', 'completed', 'failed')),
    lease_token      bigint      NOT NULL,
    lease_expires_at timestamptz NOT NULL,
    response_status  smallint,
    response_body    jsonb,
    created_at       timestamptz NOT NULL DEFAULT now(),
    expires_at       timestamptz NOT NULL,
    CHECK (state <> 'completed' OR (response_status IS NOT NULL AND response_body IS NOT NULL)),
    PRIMARY KEY (caller, key)
);

-- A table made before keys were scoped by caller gets the column and the new PRIMARY KEY; its
-- keys belong to no caller (caller ' ': the service accepts no subject with whitespace) and are
-- left to expire.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_attribute
                   WHERE attrelid = 'idempotency_keys'::regclass AND attname = 'caller' AND NOT attisdropped) THEN
        ALTER TABLE idempotency_keys ADD COLUMN caller text NOT NULL DEFAULT ' '
            CHECK (length(caller) BETWEEN 1 AND 255);
        ALTER TABLE idempotency_keys ALTER COLUMN caller DROP DEFAULT;
        ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_pkey;
        ALTER TABLE idempotency_keys ADD PRIMARY KEY (caller, key);
    END IF;
END
$$;

CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at_idx ON idempotency_keys (expires_at);

-- Deletes expired keys, at most `batch` at a time; returns how many. A key still in progress is
-- kept until its lease is over too.
CREATE OR REPLACE FUNCTION idempotency_keys_cleanup(batch int DEFAULT 10000) RETURNS bigint
LANGUAGE sql AS $$
    WITH expired AS (
        SELECT caller, key FROM idempotency_keys
        WHERE expires_at < now() AND (state <> 'in_progress' OR lease_expires_at < now())
        ORDER BY expires_at
        LIMIT batch
        FOR UPDATE SKIP LOCKED
    ), deleted AS (
        DELETE FROM idempotency_keys k USING expired
        WHERE k.caller = expired.caller AND k.key = expired.key RETURNING 1
    )
    SELECT count(*) FROM deleted;
$$;

-- Lease tokens: every claim and takeover draws a new one, so a worker that stalled past its
-- lease (and past the key's expiry and cleanup) never finds its old token valid again.
CREATE SEQUENCE IF NOT EXISTS idempotency_lease_tokens;
