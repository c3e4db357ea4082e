# Shared functions of the Debezium harness (run, capture, fixtures): the pinned jars of Kafka
# Connect and Debezium's PostgreSQL connector, and the record capture tool.
# Sourced, not run; sources deploy/local/lib.sh (log, die, the services) first.

source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"

# Kafka Connect 4.3.0 (the version Debezium 3.6.1 is built against; 4.4.0 lacks a class it loads) with Debezium 3.6.1.Final, from Maven Central
# (deploy/local/debezium/pom.xml, every jar checked against jars.sha256). Fetched once per
# machine and kept beside the Kafka and PostgreSQL builds; OUTBOX_DEBEZIUM_CACHE overrides where.
DEBEZIUM_VERSION=3.6.1.Final
DEBEZIUM_DIR=$REPO_ROOT/deploy/local/debezium
DEBEZIUM_HOME=${OUTBOX_DEBEZIUM_CACHE:-$PG_CACHE_DEFAULT}/debezium-$DEBEZIUM_VERSION
DEBEZIUM_PIN=$DEBEZIUM_DIR/jars.sha256

# ensure_debezium: Java and Maven (apt-get, when missing), then the pinned jars unless the cache
# holds exactly that set (deploy/local/lib.sh, ensure_pinned_jars).
ensure_debezium() {
    ensure_pinned_jars "Kafka Connect and Debezium $DEBEZIUM_VERSION" "$DEBEZIUM_DIR/pom.xml" "$DEBEZIUM_PIN" "$DEBEZIUM_HOME"
}

# ensure_capture: compiles Capture.java against the pinned kafka-clients, once per version of
# its source (the classes live in $DEBEZIUM_HOME/capture-<sha256 prefix>). Sets CAPTURE_CP.
ensure_capture() {
    local sum dir
    ensure_debezium
    command -v javac >/dev/null || apt_install openjdk-17-jdk-headless
    sum=$(sha256sum "$DEBEZIUM_DIR/Capture.java" | cut -c1-16)
    dir=$DEBEZIUM_HOME/capture-$sum
    if [ ! -f "$dir/Capture.class" ]; then
        rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
        javac -nowarn -cp "$DEBEZIUM_HOME/libs/*" -d "$dir.tmp" "$DEBEZIUM_DIR/Capture.java" >&2 ||
            die "cannot compile $DEBEZIUM_DIR/Capture.java"
        rm -rf "$dir" && mv "$dir.tmp" "$dir" && chmod -R a+rX "$dir"
    fi
    CAPTURE_CP="$dir:$DEBEZIUM_HOME/libs/*"
}

# capture ARGS...: runs the capture tool (see Capture.java; its logging: errors only, on stderr).
capture() {
    ensure_capture
    java -XX:TieredStopAtLevel=1 -XX:+UseSerialGC -cp "$CAPTURE_CP" -Djava.awt.headless=true \
        -Dlog4j2.configurationFile="$REPO_ROOT/deploy/local/debezium/log4j2-tools.properties" Capture "$@"
}

# stop_worker DIR: stops the Kafka Connect worker DIR/pid names (deploy/local/debezium/run
# start records it): SIGTERM to DIR/pid (Connect stops the task: it flushes the producer, writes
# its offsets and closes the replication connection), SIGKILL if it is still there after 20 s.
stop_worker() {
    local dir=$1 pid
    [ -f "$dir/pid" ] || { log "no worker recorded in $dir"; return 0; }
    pid=$(cat "$dir/pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
        log "Kafka Connect ($pid) still runs 20 s after SIGTERM: SIGKILL"
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$dir/pid"
    log "Kafka Connect stopped ($dir)"
}

# stop_workers DIR: stop_worker for every worker recorded under DIR/debezium*/ (run start's
# default state directory is $OUTBOX_LOCAL_STATE/debezium): call it before stop_services DIR,
# which knows nothing of them. Never fails (EXIT traps).
stop_workers() {
    local dir
    for dir in "$1"/debezium*/; do
        [ -f "$dir/pid" ] && { stop_worker "${dir%/}" || true; }
    done
    return 0
}
