"""Waits until a Kafka broker answers a Metadata request naming at least N brokers.

    python3 ready.py HOST:PORT N SECONDS

Exit 0 once it does; 1 if SECONDS pass first (the last error is printed). A listening port is
not a ready broker: the port opens before the broker has caught up with the metadata log, and
a cluster answers with fewer brokers until every one has registered. Metadata v4 (not flexible,
in every Kafka 4.x) with an empty topic list: the reply carries the broker list only.
"""
import socket
import struct
import sys
import time


def brokers(host, port):
    client = b"outbox-relay-ready"
    header = struct.pack(">hhih", 3, 4, 1, len(client)) + client
    body = struct.pack(">ib", 0, 0)  # no topics, no auto-creation
    request = header + body
    with socket.create_connection((host, port), timeout=2) as s:
        s.sendall(struct.pack(">i", len(request)) + request)
        size = struct.unpack(">i", read(s, 4))[0]
        reply = read(s, size)
    # correlation id, throttle_time_ms, then the broker array
    count = struct.unpack_from(">i", reply, 8)[0]
    return count


def read(s, n):
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("connection closed")
        data += chunk
    return data


def main():
    address, want, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + seconds
    last = "no answer yet"
    while time.monotonic() < deadline:
        try:
            count = brokers(host, int(port))
            if count >= want:
                return 0
            last = f"{count} of {want} brokers registered"
        except (OSError, struct.error) as e:
            last = str(e) or type(e).__name__
        time.sleep(0.2)
    print(f"{address}: not ready after {seconds:g} s ({last})", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
