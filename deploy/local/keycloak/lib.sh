# Keycloak, a real OpenID Connect provider, for the relay's SASL OAUTHBEARER tests and demo:
# its server distribution org.keycloak:keycloak-quarkus-dist (a zip on Maven Central, fetched with
# Maven, pinned by sha256 below), run on the machine's Java 17 in production mode with the
# in-memory database, the local cache (no cluster discovery between test instances) and a realm
# imported at each start (realm.json: a confidential client "outbox-relay" with the client
# credentials grant, access tokens of 60 s whose audience includes "kafka"; its secret and signing key are made once per install,
# so every instance signs alike and a restarted provider issues tokens the brokers' cached keys
# still verify). Sourced by deploy/local/lib.sh users; needs its log/die/free_ports/make_tls.
#
# Measured here (2 cores, shared): the one-time `kc.sh build` about 35 s; a start until the realm
# answers about 28 s; resident memory about 550 MB (heap capped at 512 MB).

KEYCLOAK_VERSION=26.7.3
KEYCLOAK_SHA256=27a6535553c3cdcd083872ba40629efafb3475e3b758e0c6f691395561dd0f1f
KEYCLOAK_HOME=${OUTBOX_KEYCLOAK_CACHE:-$PG_CACHE_DEFAULT}/keycloak-$KEYCLOAK_VERSION
KEYCLOAK_REALM=outbox
KEYCLOAK_CLIENT=outbox-relay

# install_keycloak: fetches the pinned zip with Maven, checks its sha256, unpacks it, builds it
# for the in-memory database and the local cache, and makes the realm's secret and signing key.
install_keycloak() {
    local tmp sum zip
    log "fetching Keycloak $KEYCLOAK_VERSION (org.keycloak:keycloak-quarkus-dist, sha256-pinned)"
    tmp=$(mktemp -d)
    if ! mvn -B -q -C -Dstyle.color=never org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy \
        -Dartifact="org.keycloak:keycloak-quarkus-dist:$KEYCLOAK_VERSION:zip" -DoutputDirectory="$tmp" \
        >"$tmp/mvn.log" 2>&1; then
        tail -20 "$tmp/mvn.log" >&2
        rm -rf "$tmp"
        die "Maven could not fetch Keycloak $KEYCLOAK_VERSION (its output is above)"
    fi
    zip=$tmp/keycloak-quarkus-dist-$KEYCLOAK_VERSION.zip
    sum=$(sha256sum "$zip" | cut -d' ' -f1)
    [ "$sum" = "$KEYCLOAK_SHA256" ] || { rm -rf "$tmp"; die "Keycloak's zip has sha256 $sum, expected $KEYCLOAK_SHA256; not running it"; }
    command -v unzip >/dev/null || apt_install unzip
    unzip -q "$zip" -d "$tmp" || { rm -rf "$tmp"; die "cannot unpack $zip"; }
    log "building Keycloak for the tests (once; about 35 s)"
    "$tmp/keycloak-$KEYCLOAK_VERSION/bin/kc.sh" build --db=dev-mem --cache=local --health-enabled=true \
        >"$tmp/build.log" 2>&1 || { tail -20 "$tmp/build.log" >&2; rm -rf "$tmp"; die "kc.sh build failed"; }
    (umask 077 && openssl rand -hex 24 >"$tmp/keycloak-$KEYCLOAK_VERSION/client.secret")
    openssl genrsa -traditional 2048 >"$tmp/keycloak-$KEYCLOAK_VERSION/realm.key" 2>/dev/null ||
        openssl genrsa 2048 >"$tmp/keycloak-$KEYCLOAK_VERSION/realm.key" 2>/dev/null || die "openssl: cannot make the realm key"
    mkdir -p "$(dirname "$KEYCLOAK_HOME")"
    rm -rf "$KEYCLOAK_HOME"
    mv "$tmp/keycloak-$KEYCLOAK_VERSION" "$KEYCLOAK_HOME"
    write_keycloak_realm
    echo "$KEYCLOAK_SHA256" >"$KEYCLOAK_HOME/installed"
    rm -rf "$tmp"
}

# write_keycloak_realm: realm.json with the install's secret and key into data/import, where
# `kc.sh start --import-realm` reads it.
write_keycloak_realm() {
    mkdir -p "$KEYCLOAK_HOME/data/import"
    python3 - "$REPO_ROOT/deploy/local/keycloak/realm.json" "$KEYCLOAK_HOME" <<'PY' || die "cannot write the Keycloak realm"
import json, sys
template, home = sys.argv[1], sys.argv[2]
realm = json.load(open(template))
secret = open(home + "/client.secret").read().strip()
key = "".join(l for l in open(home + "/realm.key").read().splitlines() if not l.startswith("-----"))
for client in realm["clients"]:
    client["secret"] = secret
realm["components"]["org.keycloak.keys.KeyProvider"][0]["config"]["privateKey"] = [key]
json.dump(realm, open(home + "/data/import/outbox-realm.json", "w"), indent=1)
PY
    cp "$REPO_ROOT/deploy/local/keycloak/realm.json" "$KEYCLOAK_HOME/realm.template.json"
}

ensure_keycloak() {
    local missing=()
    command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
    command -v mvn >/dev/null || missing+=(maven)
    if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi
    # the OAuth tests start at once, each its own stack: one installs, the others wait for it
    mkdir -p "$(dirname "$KEYCLOAK_HOME")"
    (
        flock 9 || die "cannot lock $KEYCLOAK_HOME.lock"
        [ "$(cat "$KEYCLOAK_HOME/installed" 2>/dev/null)" = "$KEYCLOAK_SHA256" ] || install_keycloak
        cmp -s "$KEYCLOAK_HOME/realm.template.json" "$REPO_ROOT/deploy/local/keycloak/realm.json" || write_keycloak_realm
    ) 9>"$KEYCLOAK_HOME.lock" || exit 1
}

# start_keycloak: Keycloak under $OUTBOX_LOCAL_STATE/keycloak on free loopback ports: HTTP (the
# brokers fetch the realm's JWKS there) and HTTPS with a test CA (the relay's token requests,
# keycloak/tls/ca.crt). Writes keycloak/start (starts it again, returns once the realm answers)
# and keycloak/pid (its process group). Sets KEYCLOAK_HTTP, KEYCLOAK_HTTPS.
start_keycloak() {
    local dir=$OUTBOX_LOCAL_STATE/keycloak http https management
    mkdir -p "$dir/tmp" "$dir/tx"
    make_tls "$dir/tls"
    read -r http https management < <(free_ports 3)
    KEYCLOAK_HTTP=$http KEYCLOAK_HTTPS=$https
    cat >"$dir/start" <<SH
#!/usr/bin/env bash
# Starts Keycloak (realm $KEYCLOAK_REALM imported anew); returns once the realm answers.
cd '$dir'
JAVA_OPTS_KC_HEAP='-Xms64m -Xmx512m' \\
JAVA_OPTS_APPEND='-XX:TieredStopAtLevel=1 -Djava.io.tmpdir=$dir/tmp -Dquarkus.transaction-manager.object-store.directory=$dir/tx' \\
    setsid '$KEYCLOAK_HOME/bin/kc.sh' start --optimized --import-realm \\
    --http-enabled=true --http-host=127.0.0.1 --http-port=$http --https-port=$https \\
    --https-certificate-file='$dir/tls/server.crt' --https-certificate-key-file='$dir/tls/server.key' \\
    --hostname-strict=false --http-management-port=$management >>'$dir/stdout.log' 2>&1 </dev/null &
echo \$! >'$dir/pid'
exec python3 -c 'import sys, time, urllib.request
for _ in range(6000):
    try:
        urllib.request.urlopen("http://127.0.0.1:$http/realms/$KEYCLOAK_REALM/.well-known/openid-configuration", timeout=1)
        sys.exit(0)
    except Exception:
        time.sleep(0.1)
sys.exit(1)'
SH
    chmod 755 "$dir/start"
    "$dir/start" || die "Keycloak did not answer within 10 minutes: $(tail -5 "$dir/stdout.log")"
}

# stop_keycloak DIR: stops the Keycloak DIR/keycloak/pid names (its process group).
stop_keycloak() {
    local pid
    [ -f "$1/keycloak/pid" ] || return 0
    pid=$(cat "$1/keycloak/pid")
    kill -CONT -- "-$pid" 2>/dev/null || true
    kill -- "-$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 -- "-$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -9 -- "-$pid" 2>/dev/null || true
}

# keycloak_env: the KEY=VALUE lines that tell a test where the identity provider is.
keycloak_env() {
    local dir=$OUTBOX_LOCAL_STATE/keycloak
    cat <<ENV
OUTBOX_RELAY_TEST_OIDC_TOKEN_URL=https://localhost:$KEYCLOAK_HTTPS/realms/$KEYCLOAK_REALM/protocol/openid-connect/token
OUTBOX_RELAY_TEST_OIDC_JWKS_URL=http://127.0.0.1:$KEYCLOAK_HTTP/realms/$KEYCLOAK_REALM/protocol/openid-connect/certs
OUTBOX_RELAY_TEST_OIDC_CA=$dir/tls/ca.crt
OUTBOX_RELAY_TEST_OIDC_CLIENT_ID=$KEYCLOAK_CLIENT
OUTBOX_RELAY_TEST_OIDC_CLIENT_SECRET_FILE=$KEYCLOAK_HOME/client.secret
OUTBOX_RELAY_TEST_KEYCLOAK_DIR=$dir
ENV
}

# start_oauth_services: Keycloak and a one-node Kafka whose OAUTH listener validates the realm's
# tokens (its JWKS, audience "kafka", the issuer of the HTTPS endpoint), in a new state directory;
# writes the settings to $OUTBOX_LOCAL_STATE/env.
start_oauth_services() {
    ensure_keycloak
    ensure_kafka
    OUTBOX_LOCAL_STATE=$(mktemp -d /tmp/outbox-relay-oauth.XXXXXX)
    chmod 755 "$OUTBOX_LOCAL_STATE"
    start_keycloak
    OUTBOX_KAFKA_OAUTH_JWKS=http://127.0.0.1:$KEYCLOAK_HTTP/realms/$KEYCLOAK_REALM/protocol/openid-connect/certs
    # the issuer of the tokens asked for at the HTTPS endpoint the relay uses
    OUTBOX_KAFKA_OAUTH_ISSUER=https://localhost:$KEYCLOAK_HTTPS/realms/$KEYCLOAK_REALM
    start_kafka 1
    { echo "OUTBOX_LOCAL_STATE=$OUTBOX_LOCAL_STATE"; kafka_env; keycloak_env; } >"$OUTBOX_LOCAL_STATE/env"
}
