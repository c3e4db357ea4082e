# Shared functions of the deploy/local scripts: install what is missing, start a throwaway
# PostgreSQL and a Kafka-protocol broker (tansu) on free loopback ports, stop them by PID.
# Sourced, not run. Everything started is recorded in $OUTBOX_LOCAL_STATE.

PG_MAJOR=${PG_MAJOR:-15}
PG_BIN=${PG_BIN:-/usr/lib/postgresql/$PG_MAJOR/bin}
TANSU_VERSION=0.6.0
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

log() { printf '[local] %s\n' "$*" >&2; }
die() { printf '[local] error: %s\n' "$*" >&2; exit 1; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else die "need root for: $*"; fi
}

apt_install() {
    log "installing $* with apt-get"
    if [ -z "${OUTBOX_APT_UPDATED:-}" ]; then
        as_root apt-get update -qq >&2 || die "apt-get update failed"
        OUTBOX_APT_UPDATED=1
    fi
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >&2 || die "apt-get install $* failed"
}

ensure_postgres() {
    [ -x "$PG_BIN/initdb" ] || apt_install "postgresql-$PG_MAJOR"
    [ -x "$PG_BIN/initdb" ] || die "PostgreSQL $PG_MAJOR binaries not found in $PG_BIN"
    command -v psql >/dev/null || apt_install postgresql-client
}

# ensure_test_tools: promtool/prometheus (alert rule tests, the real-Prometheus alert test) and
# the offline validators of the deployment files.
ensure_test_tools() {
    command -v promtool >/dev/null && command -v prometheus >/dev/null || apt_install prometheus
    # the Debian package starts a system Prometheus on :9090; the tests start their own
    if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
        as_root systemctl stop prometheus >/dev/null 2>&1 || true
    fi
    local missing=()
    command -v yamllint >/dev/null || missing+=(yamllint)
    command -v kubernetes-validate >/dev/null || missing+=(kubernetes-validate)
    python3 -c 'import yaml' 2>/dev/null || missing+=(pyyaml)
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing ${missing[*]} with pip"
        python3 -m pip install -q "${missing[@]}" >&2 || die "pip install ${missing[*]} failed"
    fi
}

tansu_bin() {
    if command -v tansu >/dev/null; then command -v tansu; else echo "${CARGO_HOME:-$HOME/.cargo}/bin/tansu"; fi
}

ensure_tansu() {
    local bin; bin=$(tansu_bin)
    if [ -x "$bin" ] && "$bin" --version 2>/dev/null | grep -q "$TANSU_VERSION"; then return; fi
    command -v cargo >/dev/null || die "cargo is needed to build the tansu broker (install Rust with rustup)"
    log "building the tansu $TANSU_VERSION broker once (about 8 minutes on 2 cores; cached in ~/.cargo/bin)"
    cargo install "tansu@$TANSU_VERSION" --locked --features dynostore >&2 || die "cargo install tansu failed"
}

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

wait_for_port() { # port seconds
    local i
    for ((i = 0; i < $2 * 10; i++)); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.1
    done
    return 1
}

as_postgres() {
    if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

# start_postgres: initdb a throwaway cluster under $OUTBOX_LOCAL_STATE/pg and start it.
start_postgres() {
    local dir=$OUTBOX_LOCAL_STATE/pg port
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown postgres: "$dir"
    as_postgres "$PG_BIN/initdb" -D "$dir/data" --auth=trust --no-sync -U postgres -E UTF8 >"$dir/initdb.log" 2>&1 ||
        die "initdb failed: see $dir/initdb.log"
    port=$(free_port)
    as_postgres "$PG_BIN/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 start -o "\
        -c listen_addresses=127.0.0.1 -c port=$port -c unix_socket_directories=$dir \
        -c wal_level=${OUTBOX_WAL_LEVEL:-logical} -c max_replication_slots=32 -c max_wal_senders=32 \
        -c max_slot_wal_keep_size=4GB -c wal_sender_timeout=60s \
        -c fsync=off -c full_page_writes=off \
        -c max_connections=200" >/dev/null || die "PostgreSQL did not start: see $dir/server.log"
    head -1 "$dir/data/postmaster.pid" >"$OUTBOX_LOCAL_STATE/postgres.pid"
    echo "$port" >"$OUTBOX_LOCAL_STATE/postgres.port"
    PG_URL="postgres://postgres@127.0.0.1:$port/postgres"
    PG_PORT=$port
}

start_broker() {
    local dir=$OUTBOX_LOCAL_STATE/broker port bin
    mkdir -p "$dir"
    port=$(free_port)
    bin=$(tansu_bin)
    setsid "$bin" broker \
        --listener-url "tcp://127.0.0.1:$port" \
        --advertised-listener-url "tcp://127.0.0.1:$port" \
        --storage-engine memory://tansu/ \
        >"$dir/broker.log" 2>&1 </dev/null &
    echo $! >"$OUTBOX_LOCAL_STATE/broker.pid"
    echo "$port" >"$OUTBOX_LOCAL_STATE/broker.port"
    wait_for_port "$port" 60 || die "the broker did not listen on 127.0.0.1:$port: see $dir/broker.log"
    KAFKA_BROKERS="127.0.0.1:$port"
    KAFKA_PORT=$port
}

# stop_services DIR: stops what DIR records, by PID, and removes DIR. Never fails: it runs
# from EXIT traps under `set -e`.
stop_services() {
    local state=$1 pid
    [ -d "$state" ] || return 0
    if [ -f "$state/broker.pid" ]; then
        pid=$(cat "$state/broker.pid")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    if [ -f "$state/postgres.pid" ] && [ -d "$state/pg/data" ]; then
        as_postgres "$PG_BIN/pg_ctl" -D "$state/pg/data" -m immediate -w stop >/dev/null 2>&1 ||
            kill -9 "$(cat "$state/postgres.pid")" 2>/dev/null || true
    fi
    rm -rf "$state" || true
}

# start_postgres_only: as start_services, without the broker (tests that need a second,
# differently configured server, e.g. OUTBOX_WAL_LEVEL=replica).
start_postgres_only() {
    ensure_postgres
    OUTBOX_LOCAL_STATE=$(mktemp -d /tmp/outbox-relay-local.XXXXXX)
    chmod 755 "$OUTBOX_LOCAL_STATE"
    start_postgres
    echo "OUTBOX_LOCAL_STATE=$OUTBOX_LOCAL_STATE" >"$OUTBOX_LOCAL_STATE/env"
    echo "OUTBOX_RELAY_TEST_PG_URL=$PG_URL" >>"$OUTBOX_LOCAL_STATE/env"
}

# start_services: installs what is missing, starts both services in a new state directory
# and exports OUTBOX_LOCAL_STATE, PG_URL, KAFKA_BROKERS and the test variables.
start_services() {
    ensure_postgres
    ensure_tansu
    OUTBOX_LOCAL_STATE=$(mktemp -d /tmp/outbox-relay-local.XXXXXX)
    chmod 755 "$OUTBOX_LOCAL_STATE"
    start_postgres
    start_broker
    export OUTBOX_LOCAL_STATE PG_URL PG_PORT KAFKA_BROKERS KAFKA_PORT
    export OUTBOX_RELAY_TEST_PG_URL=$PG_URL OUTBOX_RELAY_TEST_KAFKA=$KAFKA_BROKERS
    cat >"$OUTBOX_LOCAL_STATE/env" <<ENV
OUTBOX_LOCAL_STATE=$OUTBOX_LOCAL_STATE
OUTBOX_RELAY_TEST_PG_URL=$PG_URL
OUTBOX_RELAY_TEST_KAFKA=$KAFKA_BROKERS
ENV
    log "PostgreSQL $PG_MAJOR: $PG_URL (wal_level=logical; psql \"$PG_URL\")"
    log "Kafka-protocol broker (tansu $TANSU_VERSION, in memory): $KAFKA_BROKERS"
    log "state and logs: $OUTBOX_LOCAL_STATE"
}

# apply_schema URL: applies sql/[0-9]*.sql in order.
apply_schema() {
    local f
    for f in "$REPO_ROOT"/sql/[0-9]*.sql; do
        PGOPTIONS='-c client_min_messages=warning' psql -q -v ON_ERROR_STOP=1 -X -d "$1" -f "$f" >/dev/null ||
            die "applying $f failed"
    done
}
