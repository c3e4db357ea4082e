# Zipkin, a tracing backend with a UI in the same download, for the screenshot of a trace in
# docs/tracing.md: the server io.zipkin:zipkin-server (its executable jar on Maven Central, pinned
# by sha256 below; Maven Central's own .sha1 of it matched when it was pinned), run on the
# machine's Java 17 with in-memory storage on a free loopback port. Its UI (Zipkin Lens) is at
# /zipkin/, its API at /api/v2/.
#
# Why beside Jaeger: the Jaeger the tests query is built from its Go module, which does not hold
# Jaeger's UI assets (jaeger-ui is published neither in the module nor on npm), so that Jaeger
# serves a placeholder page where its UI would be. Zipkin takes the same spans from Jaeger:
# Jaeger's traces pipeline can also export to a Kafka topic in Zipkin's JSON encoding (the
# OpenTelemetry kafkaexporter, part of Jaeger's build; start_jaeger with OUTBOX_JAEGER_KAFKA),
# and Zipkin's Kafka collector consumes that topic (start_zipkin with OUTBOX_ZIPKIN_KAFKA).
# Sourced by deploy/local/lib.sh users; needs its helpers (log, die, apt_install, free_ports,
# wait_http, install_once, stop_group) and PG_CACHE_DEFAULT.
#
# Measured here (2 cores, shared): a start until /health answers 5 to 10 s; resident memory about
# 250 MB (heap capped at 256 MB).

ZIPKIN_VERSION=3.6.1
ZIPKIN_SHA256=d8326e0ed4f43855dba81228f688554706e52578a7c782d9a90b73f8680654a1
ZIPKIN_URL=https://repo1.maven.org/maven2/io/zipkin/zipkin-server/$ZIPKIN_VERSION/zipkin-server-$ZIPKIN_VERSION-exec.jar
ZIPKIN_HOME=${OUTBOX_ZIPKIN_CACHE:-$PG_CACHE_DEFAULT}/zipkin-$ZIPKIN_VERSION

# install_zipkin: downloads the pinned jar and checks its sha256.
install_zipkin() {
    local tmp sum
    log "fetching Zipkin $ZIPKIN_VERSION (io.zipkin:zipkin-server from Maven Central, sha256-pinned)"
    tmp=$(mktemp -d)
    curl -sSfL --retry 3 -o "$tmp/zipkin.jar" "$ZIPKIN_URL" || { rm -rf "$tmp"; die "cannot download $ZIPKIN_URL"; }
    sum=$(sha256sum "$tmp/zipkin.jar" | cut -d' ' -f1)
    [ "$sum" = "$ZIPKIN_SHA256" ] || { rm -rf "$tmp"; die "Zipkin's jar ($ZIPKIN_URL) has sha256 $sum, expected $ZIPKIN_SHA256; not running it"; }
    mkdir -p "$ZIPKIN_HOME"
    mv "$tmp/zipkin.jar" "$ZIPKIN_HOME/zipkin-server-$ZIPKIN_VERSION-exec.jar"
    echo "$ZIPKIN_SHA256" >"$ZIPKIN_HOME/installed"
    rm -rf "$tmp"
}

ensure_zipkin() {
    local missing=()
    command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
    command -v curl >/dev/null || missing+=(curl)
    if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi
    install_once "$ZIPKIN_HOME" "$ZIPKIN_SHA256" install_zipkin
}

# start_zipkin: Zipkin under $OUTBOX_LOCAL_STATE/zipkin on a free loopback port, spans in memory.
# With OUTBOX_ZIPKIN_KAFKA=BOOTSTRAP it also consumes spans (Zipkin's JSON or proto3, a list per
# message) from the topic OUTBOX_ZIPKIN_KAFKA_TOPIC (default zipkin), from its earliest offset, in a
# consumer group of its own. Writes zipkin/pid (its process group) and zipkin/start; returns once
# /health answers (with a Kafka collector, once it is up too). Sets ZIPKIN_PORT.
start_zipkin() {
    local dir=$OUTBOX_LOCAL_STATE/zipkin kafka=${OUTBOX_ZIPKIN_KAFKA:-} topic=${OUTBOX_ZIPKIN_KAFKA_TOPIC:-zipkin}
    mkdir -p "$dir"
    ZIPKIN_PORT=$(free_port)
    # (the JVM options as Kafka's brokers take them in the tests: the quick JIT tier and the
    # serial collector start it with half the CPU)
    cat >"$dir/start" <<SH
#!/usr/bin/env bash
# Starts Zipkin; its variables are the server's own (zipkin-server-shared.yml in the jar). An
# empty KAFKA_BOOTSTRAP_SERVERS leaves the Kafka collector off.
export STORAGE_TYPE=mem QUERY_PORT=$ZIPKIN_PORT KAFKA_BOOTSTRAP_SERVERS='$kafka' KAFKA_TOPIC='$topic' \\
    KAFKA_GROUP_ID='zipkin-$ZIPKIN_PORT' SELF_TRACING_ENABLED=false
# (Armeria's port list replaces the server's: bound to loopback only)
setsid java ${OUTBOX_ZIPKIN_JVM_OPTS:--Xms64m -Xmx256m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC} \\
    -jar '$ZIPKIN_HOME/zipkin-server-$ZIPKIN_VERSION-exec.jar' \\
    '--armeria.ports[0].ip=127.0.0.1' '--armeria.ports[0].port=$ZIPKIN_PORT' '--armeria.ports[0].protocols[0]=http' \\
    >>'$dir/stdout.log' 2>&1 </dev/null &
echo \$! >'$dir/pid'
SH
    chmod 755 "$dir/start"
    "$dir/start"
    wait_http "http://127.0.0.1:$ZIPKIN_PORT/health" Zipkin "$dir/stdout.log"
}

# stop_zipkin DIR: stops the Zipkin DIR/zipkin/pid names.
stop_zipkin() {
    stop_group "$1/zipkin/pid"
}

# zipkin_env: the KEY=VALUE lines that tell a test where Zipkin is.
zipkin_env() {
    cat <<ENV
OUTBOX_RELAY_TEST_ZIPKIN_URL=http://127.0.0.1:$ZIPKIN_PORT
OUTBOX_RELAY_TEST_ZIPKIN_DIR=$OUTBOX_LOCAL_STATE/zipkin
ENV
}
