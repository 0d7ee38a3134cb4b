#!/usr/bin/env python3
"""A small orders service with a deliberately broken idempotency middleware.

Python 3 standard library only. It exists to show what `idem check` finds
(see README.md next to it):

    python3 examples/broken-idempotency/server.py --port 3000
    idem check http://127.0.0.1:3000/orders -d '{"sku":"A-1","qty":1}' \
        --count-url http://127.0.0.1:3000/count --slow-header 'X-Delay-Ms: 300'

POST (any path) creates an order: it counts one execution, sleeps for the
work (--work-ms, default 50, or the request's X-Delay-Ms) and answers 201
with a JSON body unique to the execution, a Location and an ETag.
GET /count answers {"executions": N}.

The middleware keeps one record per Idempotency-Key. With --faults none it
is correct: it claims the key atomically (under a lock) before the work, so
a copy that arrives meanwhile gets 409 with Retry-After, a retry after the
work gets the stored answer, and the same key with another request gets
422. Each fault breaks one rule, as real middlewares do:

  race          check-then-set: read the key, and if absent do the work and
                store the answer afterwards. Concurrent copies, and a retry
                while the first still runs, all run. (The default.)
  raw-body      the fingerprint hashes the raw body bytes: the same JSON
                with its members in another order, or other whitespace,
                gets 422.
  any-path      the fingerprint leaves the path out: the same key on
                another path gets the first path's answer.
  any-body      the fingerprint leaves the body out: the same key with
                another body gets the first answer.
  lose-headers  a replay carries the status and body only: Location and
                ETag are lost.
  any-key       no key validation: an empty, 300-character or tab-holding
                key is used as it is.
  no-retry-after  a copy that arrives while the first runs gets 409 without
                Retry-After (only without race, which never answers 409).

Prints "listening on http://127.0.0.1:PORT" once it serves (--port 0 picks
a free port).
"""

import argparse
import hashlib
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAULTS = {"race", "raw-body", "any-path", "any-body", "lose-headers", "any-key", "no-retry-after"}

lock = threading.Lock()
executions = 0
records = {}  # key -> {"fingerprint": str, "response": (status, headers, body)} or "in-flight"


def fingerprint(faults, method, path, body):
    if "raw-body" not in faults:
        try:
            body = json.dumps(json.loads(body), sort_keys=True, separators=(",", ":")).encode()
        except ValueError:
            pass
    where = "" if "any-path" in faults else path
    if "any-body" in faults:
        body = b""
    return hashlib.sha256(method.encode() + b" " + where.encode() + b"\n" + body).hexdigest()


def valid_key(key):
    return 1 <= len(key) <= 255 and all(0x20 <= ord(c) <= 0x7E for c in key) and key.strip()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    faults = set()
    work_ms = 50

    def log_message(self, fmt, *args):  # quiet
        pass

    def answer(self, status, headers, body):
        try:
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client hung up; the work is done and stored anyway

    def problem(self, status, kind, detail, extra=()):
        body = json.dumps({"type": "urn:example:" + kind, "status": status, "detail": detail}).encode()
        self.answer(status, [("Content-Type", "application/problem+json"), *extra], body)

    def do_GET(self):
        if self.path == "/count":
            body = json.dumps({"executions": executions}).encode()
            self.answer(200, [("Content-Type", "application/json")], body)
        else:
            self.problem(404, "not-found", "no such resource")

    def work(self, body):
        """The business operation: one execution, a unique answer."""
        global executions
        with lock:
            executions += 1
            n = executions
        delay = self.headers.get("X-Delay-Ms")
        time.sleep((int(delay) if delay and delay.isdigit() else self.work_ms) / 1000)
        try:
            order = json.loads(body or b"{}")
        except ValueError:
            order = {"raw": body.decode("utf-8", "replace")}
        out = json.dumps({"id": n, "order": order, "status": "created"}).encode()
        headers = [
            ("Content-Type", "application/json"),
            ("Location", "/orders/%d" % n),
            ("ETag", '"order-%d-v1"' % n),
        ]
        return 201, headers, out

    def replay(self, response):
        status, headers, body = response
        if "lose-headers" in self.faults:
            headers = [h for h in headers if h[0] == "Content-Type"]
        self.answer(status, headers + [("Idempotent-Replayed", "true")], body)

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        key = self.headers.get("Idempotency-Key")
        if key is None:
            self.answer(*self.work(body))
            return
        if "any-key" not in self.faults and not valid_key(key):
            self.problem(400, "invalid-key", "the key must be 1-255 printable ASCII characters")
            return
        fp = fingerprint(self.faults, "POST", self.path, body)
        if "race" in self.faults:
            # Check, then set: nothing marks the key while the work runs.
            record = records.get(key)
            if record is None:
                response = self.work(body)
                records[key] = {"fingerprint": fp, "response": response}
                self.answer(*response)
                return
        else:
            with lock:
                record = records.get(key)
                if record is None:
                    records[key] = "in-flight"
            if record is None:
                response = self.work(body)
                with lock:
                    records[key] = {"fingerprint": fp, "response": response}
                self.answer(*response)
                return
            if record == "in-flight":
                wait = [] if "no-retry-after" in self.faults else [("Retry-After", "1")]
                self.problem(409, "in-flight", "the first request with this key is still running", wait)
                return
        if record["fingerprint"] != fp:
            self.problem(422, "key-mismatch", "this key was used for another request")
            return
        self.replay(record["response"])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=3000)
    p.add_argument("--work-ms", type=int, default=50, help="how long the work takes (default 50)")
    p.add_argument("--faults", default="race",
                   help="comma-separated: %s, or none (default: race)" % ", ".join(sorted(FAULTS)))
    args = p.parse_args()
    faults = set() if args.faults in ("", "none") else set(args.faults.split(","))
    unknown = faults - FAULTS
    if unknown:
        p.error("unknown fault(s): %s; the faults are %s" % (", ".join(sorted(unknown)), ", ".join(sorted(FAULTS))))
    Handler.faults = faults
    Handler.work_ms = args.work_ms
    ThreadingHTTPServer.request_queue_size = 128
    ThreadingHTTPServer.daemon_threads = True
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print("listening on http://127.0.0.1:%d (faults: %s)" % (server.server_address[1], ",".join(sorted(faults)) or "none"), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
