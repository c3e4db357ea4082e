#!/usr/bin/env bash
# Applies the outbox schema and the example services' tables to the "app" database, gives ten
# customers a wallet, makes the example services' least-privilege roles (sql/examples/roles.sql),
# and gives the relay's and the services' roles a password (compose only; use a secret elsewhere).
set -euo pipefail
for f in /docker-entrypoint-initdb.d/schema/[0-9]*.sql /docker-entrypoint-initdb.d/schema/examples/{orders,idempotency,ledger}.sql; do
    psql -v ON_ERROR_STOP=1 -U postgres -d app -f "$f"
done
psql -v ON_ERROR_STOP=1 -U postgres -d app -f /docker-entrypoint-initdb.d/schema/examples/roles.sql
psql -v ON_ERROR_STOP=1 -U postgres -d app -c "ALTER ROLE outbox_relay PASSWORD 'relay'" \
    -c "ALTER ROLE orders_service PASSWORD 'orders'" -c "ALTER ROLE ledger_service PASSWORD 'ledger'" \
    -c "CREATE PUBLICATION outbox_relay FOR TABLE outbox_events WITH (publish = 'insert', publish_via_partition_root = true)"
psql -v ON_ERROR_STOP=1 -U postgres -d app \
    -c "INSERT INTO wallets SELECT 'customer-' || n, 100000 FROM generate_series(0, 9) n ON CONFLICT DO NOTHING"
