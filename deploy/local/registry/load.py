"""A bounded load on a local schema registry, for deploy/local/registry/measure.

    python3 load.py URL [SCHEMAS]

Registers SCHEMAS (default 500) distinct Avro schemas over 25 subjects, looks each up by
content once, and fetches each by id four times, over one keep-alive connection. Prints
"requests seconds" on one line. Only for a registry on this machine (URL on 127.0.0.1).
"""
import http.client
import json
import sys
import time
import urllib.parse


def main():
    url = urllib.parse.urlsplit(sys.argv[1])
    assert url.hostname in ("127.0.0.1", "localhost"), "only a local registry"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 500
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    headers = {"Content-Type": "application/vnd.schemaregistry.v1+json"}
    count = 0

    def call(method, path, body=None):
        nonlocal count
        conn.request(method, url.path + path, body=json.dumps(body) if body is not None else None, headers=headers)
        r = conn.getresponse()
        data = r.read()
        count += 1
        if r.status != 200:
            raise SystemExit(f"{method} {path}: HTTP {r.status} {data[:200]!r}")
        return json.loads(data)

    start = time.monotonic()
    ids = []
    for i in range(n):
        # each subject's versions only add optional fields: compatible under any rule
        fields = [{"name": "id", "type": "long"}] + [
            {"name": f"f{j}", "type": ["null", "string"], "default": None} for j in range(i // 25)
        ]
        schema = json.dumps({"type": "record", "name": f"R{i % 25}", "namespace": "load", "fields": fields})
        subject = f"load-{i % 25}-value"
        ids.append(call("POST", f"/subjects/{subject}/versions", {"schema": schema})["id"])
        assert call("POST", f"/subjects/{subject}", {"schema": schema})["id"] == ids[-1]
    for _ in range(4):
        for schema_id in ids:
            call("GET", f"/schemas/ids/{schema_id}")
    print(count, round(time.monotonic() - start, 2))


if __name__ == "__main__":
    main()
