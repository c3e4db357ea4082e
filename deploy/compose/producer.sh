#!/usr/bin/env bash
# Writes two sample orders a second, each with its event in the same transaction.
set -u
until psql -h postgres -U postgres -d app -c "SELECT 1 FROM orders LIMIT 1" >/dev/null 2>&1; do sleep 1; done
n=0
while true; do
    n=$((n + 1))
    psql -h postgres -U postgres -d app -q -c "SELECT place_order('customer-$n', $((RANDOM % 10000 + 100)))" >/dev/null
    sleep 0.5
done
