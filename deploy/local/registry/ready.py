"""Waits until the schema registry answers 200 at URL (its /apis/ccompat/v7/subjects).

    python3 ready.py [--pid PID] [--cacert CA] [--basic-auth-file FILE] URL SECONDS

Exit 0 once it does; 1 if SECONDS pass first, the process PID has ended, or the registry answers
401/403 (it is up, but refuses the credentials); the last error is printed. Quarkus opens its HTTP port once the application has started, but a 200 with the
test's credentials also proves the TLS and basic-auth set-up. FILE holds USER:PASS.
"""
import argparse
import base64
import os
import ssl
import sys
import time
import urllib.error
import urllib.request


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pid", type=int)
    p.add_argument("--cacert")
    p.add_argument("--basic-auth-file")
    p.add_argument("url")
    p.add_argument("seconds", type=float)
    a = p.parse_args()
    headers = {}
    if a.basic_auth_file:
        with open(a.basic_auth_file) as f:
            token = base64.b64encode(f.read().strip().encode()).decode()
        headers["Authorization"] = "Basic " + token
    context = ssl.create_default_context(cafile=a.cacert) if a.cacert else None
    deadline = time.monotonic() + a.seconds
    last = "no attempt"
    while time.monotonic() < deadline:
        if a.pid:
            try:
                os.kill(a.pid, 0)
            except ProcessLookupError:
                print(f"ready.py: the registry (pid {a.pid}) has exited: {last}", file=sys.stderr)
                return 1
        try:
            req = urllib.request.Request(a.url, headers=headers)
            with urllib.request.urlopen(req, timeout=2, context=context) as r:
                if r.status == 200:
                    return 0
                last = f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                # up, but refusing the credentials: no use waiting
                print(f"ready.py: {a.url} answers HTTP {e.code} to {'its' if headers else 'no'} credentials", file=sys.stderr)
                return 1
            last = f"HTTP {e.code}"
        except Exception as e:  # not listening yet, TLS handshake, time-out
            last = repr(e)
        time.sleep(0.1)
    print(f"ready.py: {a.url} did not answer 200 within {a.seconds:g} s: {last}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
