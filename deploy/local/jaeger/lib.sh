# Jaeger, a real tracing backend (OTLP/HTTP receiver, query API and UI in one process), for the
# relay's tracing tests and demo: the Go module github.com/jaegertracing/jaeger, pinned at
# v1.75.0 by the module proxy's checksum below, built once with Go (its `cmd/jaeger`, the
# collector-based all-in-one) and run with in-memory storage on free loopback ports.
# Sourced by deploy/local/lib.sh users; needs its helpers (log, die, apt_install, free_ports,
# wait_http, install_once, stop_group) and PG_CACHE_DEFAULT.
#
# `go install ...@version` refuses this module (its go.mod has a replace directive), so the
# module is downloaded (checksum-verified by Go against sum.golang.org and again here) and built
# from a copy.

JAEGER_VERSION=1.75.0
JAEGER_MODULE_SUM=h1:OWj6uKRJ8QaH+AVypRwqINGi3Q/WOchbEfp53FJK0Xk=
JAEGER_HOME=${OUTBOX_JAEGER_CACHE:-$PG_CACHE_DEFAULT}/jaeger-$JAEGER_VERSION

# install_jaeger: downloads the pinned module, checks its sum, builds bin/jaeger.
install_jaeger() {
    local tmp info dir sum
    # Debian's golang-go is older than the module asks for: Go (GOTOOLCHAIN=auto, its default)
    # then fetches the toolchain its go.mod names from the module proxy
    command -v go >/dev/null || apt_install golang-go
    log "building Jaeger $JAEGER_VERSION from the Go module proxy (once; a few minutes)"
    tmp=$(mktemp -d)
    info=$(go mod download -json "github.com/jaegertracing/jaeger@v$JAEGER_VERSION") ||
        { rm -rf "$tmp"; die "the Go module proxy did not serve github.com/jaegertracing/jaeger@v$JAEGER_VERSION"; }
    sum=$(printf '%s' "$info" | python3 -c 'import json, sys; print(json.load(sys.stdin)["Sum"])')
    dir=$(printf '%s' "$info" | python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')
    [ "$sum" = "$JAEGER_MODULE_SUM" ] || { rm -rf "$tmp"; die "Jaeger's module has sum $sum, expected $JAEGER_MODULE_SUM; not building it"; }
    cp -r "$dir" "$tmp/src" && chmod -R u+w "$tmp/src"
    (cd "$tmp/src" && GOFLAGS=-buildvcs=false go build -trimpath -o "$tmp/jaeger" ./cmd/jaeger) >"$tmp/build.log" 2>&1 ||
        { tail -20 "$tmp/build.log" >&2; rm -rf "$tmp"; die "go build of Jaeger failed (its output is above)"; }
    mkdir -p "$JAEGER_HOME/bin"
    mv "$tmp/jaeger" "$JAEGER_HOME/bin/jaeger"
    echo "$JAEGER_MODULE_SUM" >"$JAEGER_HOME/installed"
    rm -rf "$tmp"
}

ensure_jaeger() {
    install_once "$JAEGER_HOME" "$JAEGER_MODULE_SUM" install_jaeger
}

# start_jaeger: Jaeger under $OUTBOX_LOCAL_STATE/jaeger: OTLP/HTTP and the query API/UI on free
# loopback ports, spans in memory. With OUTBOX_JAEGER_KAFKA=BOOTSTRAP its traces pipeline also
# exports every span to the Kafka topic OUTBOX_JAEGER_KAFKA_TOPIC (default zipkin) in Zipkin's
# JSON encoding, for a Zipkin (deploy/local/zipkin) to show. Writes jaeger/pid (its process group)
# and jaeger/start. Sets JAEGER_OTLP, JAEGER_QUERY.
start_jaeger() {
    local dir=$OUTBOX_LOCAL_STATE/jaeger otlp query grpc health exporters=jaeger_storage_exporter kafka_exporter=""
    mkdir -p "$dir"
    read -r otlp query grpc health < <(free_ports 4)
    JAEGER_OTLP=$otlp JAEGER_QUERY=$query
    if [ -n "${OUTBOX_JAEGER_KAFKA:-}" ]; then
        # the OpenTelemetry Collector's kafkaexporter (v0.139.0 in Jaeger 1.75.0's build; its
        # config.go): traces::topic and traces::encoding, zipkin_json a JSON list of Zipkin v2
        # spans per message, keyed by trace id
        exporters="jaeger_storage_exporter, kafka"
        kafka_exporter="  kafka:
    brokers: [\"$OUTBOX_JAEGER_KAFKA\"]
    client_id: jaeger
    partition_traces_by_id: true
    traces:
      topic: ${OUTBOX_JAEGER_KAFKA_TOPIC:-zipkin}
      encoding: zipkin_json"
    fi
    cat >"$dir/config.yaml" <<YAML
service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [$exporters]
  telemetry:
    metrics:
      level: none
    logs:
      level: warn
extensions:
  healthcheckv2:
    use_v2: true
    http:
      endpoint: 127.0.0.1:$health
  jaeger_query:
    enable_tracing: false
    storage:
      traces: memstore
    http:
      endpoint: 127.0.0.1:$query
    grpc:
      endpoint: 127.0.0.1:$grpc
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 100000
receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:$otlp
processors:
  batch:
    timeout: 100ms
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
$kafka_exporter
YAML
    cat >"$dir/start" <<SH
#!/usr/bin/env bash
# Starts Jaeger; returns once its query API answers.
setsid '$JAEGER_HOME/bin/jaeger' --config '$dir/config.yaml' >>'$dir/stdout.log' 2>&1 </dev/null &
echo \$! >'$dir/pid'
SH
    chmod 755 "$dir/start"
    "$dir/start"
    wait_http "http://127.0.0.1:$query/api/services" Jaeger "$dir/stdout.log"
}

# stop_jaeger DIR: stops the Jaeger DIR/jaeger/pid names.
stop_jaeger() {
    stop_group "$1/jaeger/pid"
}

# jaeger_env: the KEY=VALUE lines that tell a test where the tracing backend is.
jaeger_env() {
    cat <<ENV
OUTBOX_RELAY_TEST_OTLP_TRACES_URL=http://127.0.0.1:$JAEGER_OTLP/v1/traces
OUTBOX_RELAY_TEST_JAEGER_URL=http://127.0.0.1:$JAEGER_QUERY
OUTBOX_RELAY_TEST_JAEGER_DIR=$OUTBOX_LOCAL_STATE/jaeger
ENV
}
