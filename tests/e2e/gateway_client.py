#!/usr/bin/env python3
"""End-to-end check of a running idem gateway, from a client in another language.

Usage: gateway_client.py GATEWAY_URL STATS_URL

GATEWAY_URL is the gateway (e.g. http://127.0.0.1:8000) in front of the demo
payment service; STATS_URL is the service's own stats endpoint
(e.g. http://127.0.0.1:41234/payments/stats), which reports {"charges": N}.
Standard library only. Exits 0 when every check passes, 1 otherwise.
"""

import http.client
import json
import sys
import threading
import time
import urllib.parse
import uuid

TIMEOUT_S = 30
DUPLICATES = 20


class Reply:
    def __init__(self, status, headers, body):
        self.status = status
        self.headers = headers  # list of (name, value), names lower-case
        self.body = body

    def header(self, name):
        values = [v for (n, v) in self.headers if n == name.lower()]
        return values[0] if values else None

    def json(self):
        return json.loads(self.body.decode("utf-8"))

    def __repr__(self):
        return "Reply(%d, %r, %r)" % (self.status, self.headers, self.body[:300])


def request(base, method, path, body=None, headers=()):
    """One request on a fresh connection; headers may repeat a name."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=TIMEOUT_S)
    try:
        conn.putrequest(method, path)
        data = body.encode("utf-8") if isinstance(body, str) else body
        for name, value in headers:
            conn.putheader(name, value)
        if data is not None:
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(data)))
        conn.endheaders(data)
        resp = conn.getresponse()
        payload = resp.read()
        return Reply(resp.status, [(n.lower(), v) for (n, v) in resp.getheaders()], payload)
    finally:
        conn.close()


def charges(stats_url):
    url = urllib.parse.urlsplit(stats_url)
    reply = request("%s://%s" % (url.scheme, url.netloc), "GET", url.path or "/")
    check(reply.status == 200, "stats endpoint answered %r" % reply)
    return reply.json()["charges"]


failures = []


def check(condition, message):
    if not condition:
        failures.append(message)
        print("  FAIL: " + message)
    return condition


def expect_problem(reply, status, kind, what):
    ok = check(reply.status == status, "%s: expected %d, got %r" % (what, status, reply))
    ctype = reply.header("content-type") or ""
    ok &= check(ctype.startswith("application/problem+json"),
                "%s: expected application/problem+json, got %r" % (what, ctype))
    if ok:
        try:
            problem = reply.json()
        except ValueError:
            return check(False, "%s: problem body is not JSON: %r" % (what, reply.body))
        ok &= check(problem.get("type") == "urn:idem:problem:" + kind,
                    "%s: expected type urn:idem:problem:%s, got %r" % (what, kind, problem.get("type")))
        ok &= check(problem.get("status") in (None, status),
                    "%s: problem status %r differs from %d" % (what, problem.get("status"), status))
    return ok


def post_payment(gateway, body, headers=()):
    return request(gateway, "POST", "/payments", body, headers)


def test_concurrent_duplicates(gateway, stats_url):
    print("- %d concurrent duplicates (same key, same body) run once" % DUPLICATES)
    key = "e2e-" + str(uuid.uuid4())
    body = '{"amount_cents": 1234, "currency": "EUR"}'
    before = charges(stats_url)
    barrier = threading.Barrier(DUPLICATES)
    replies = [None] * DUPLICATES
    errors = []

    def worker(i):
        try:
            barrier.wait()
            replies[i] = post_payment(gateway, body, [("Idempotency-Key", key)])
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(DUPLICATES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 2)
    check(not errors, "requests failed: %r" % errors)
    executed = charges(stats_url) - before
    check(executed == 1, "expected 1 execution for %d duplicates, the service counted %d"
          % (DUPLICATES, executed))

    got = [r for r in replies if r is not None]
    statuses = {}
    for r in got:
        label = "%d%s" % (r.status, " replayed" if r.header("idempotent-replayed") == "true" else "")
        statuses[label] = statuses.get(label, 0) + 1
    print("  answers: %s; executions: %d" % (statuses, executed))
    originals = [r for r in got if r.status == 201 and r.header("idempotent-replayed") is None]
    check(len(originals) == 1, "expected one original 201, got %d" % len(originals))
    for r in got:
        if r.status == 409:
            ra = r.header("retry-after")
            check(ra is not None and ra.isdigit() and int(ra) >= 1,
                  "409 without a valid Retry-After: %r" % r)
            expect_problem(r, 409, "in-flight", "in-flight duplicate")
        elif r.status == 201:
            if originals:
                check(r.body == originals[0].body, "a 201 differs from the original: %r" % r)
        else:
            check(False, "unexpected answer to a duplicate: %r" % r)
    return key, body, (originals[0] if originals else None)


def wait_until_done(gateway, key, body):
    """Retries until the key is no longer in flight; returns the last reply."""
    deadline = time.time() + TIMEOUT_S
    while True:
        reply = post_payment(gateway, body, [("Idempotency-Key", key)])
        if reply.status != 409 or time.time() > deadline:
            return reply
        time.sleep(0.1)


def test_replay(gateway, stats_url, key, body, original):
    print("- a retry after completion is a byte-for-byte replay")
    before = charges(stats_url)
    reply = wait_until_done(gateway, key, body)
    check(reply.status == 201, "replay status: expected 201, got %r" % reply)
    check(reply.header("idempotent-replayed") == "true",
          "replay lacks Idempotent-Replayed: true: %r" % reply)
    if original is not None:
        check(reply.body == original.body, "replayed body differs: %r vs %r" % (reply.body, original.body))
        check(reply.header("location") == original.header("location"),
              "replayed Location differs: %r vs %r" % (reply.header("location"), original.header("location")))
    check(charges(stats_url) == before, "a replay ran the charge again")


def test_mismatch(gateway, stats_url, key):
    print("- the same key with another body is refused with 422")
    before = charges(stats_url)
    reply = post_payment(gateway, '{"amount_cents": 99999, "currency": "EUR"}', [("Idempotency-Key", key)])
    expect_problem(reply, 422, "key-mismatch", "key reused with another body")
    check(charges(stats_url) == before, "a mismatching request ran the charge")


def test_bad_keys(gateway, stats_url):
    print("- a blank key and two keys are 400, and nothing runs")
    before = charges(stats_url)
    body = '{"amount_cents": 500, "currency": "EUR"}'
    for keys, kind, what in [
        (["   "], "invalid-key", "blank key"),
        ([""], "invalid-key", "empty key"),
        (["a-" + str(uuid.uuid4()), "b-" + str(uuid.uuid4())], "multiple-keys", "two Idempotency-Key fields"),
    ]:
        reply = post_payment(gateway, body, [("Idempotency-Key", k) for k in keys])
        expect_problem(reply, 400, kind, what)
    check(charges(stats_url) == before, "a request with a bad key ran the charge")


def test_no_key_passes_through(gateway, stats_url):
    print("- requests without a key pass through: each one runs")
    before = charges(stats_url)
    body = '{"amount_cents": 700, "currency": "EUR"}'
    first = post_payment(gateway, body)
    second = post_payment(gateway, body)
    for r in (first, second):
        check(r.status == 201, "no-key request: expected 201, got %r" % r)
        check(r.header("idempotent-replayed") is None, "no-key request was replayed: %r" % r)
    if first.status == 201 and second.status == 201:
        check(first.json()["payment_id"] != second.json()["payment_id"],
              "two no-key requests got the same payment")
    executed = charges(stats_url) - before
    check(executed == 2, "expected 2 executions for 2 requests without a key, got %d" % executed)
    # A GET is not guarded either.
    got = request(gateway, "GET", "/payments/stats")
    check(got.status == 200 and "charges" in got.json(), "GET through the gateway: %r" % got)


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    gateway, stats_url = argv[1].rstrip("/"), argv[2]
    print("gateway %s, service stats %s" % (gateway, stats_url))
    key, body, original = test_concurrent_duplicates(gateway, stats_url)
    test_replay(gateway, stats_url, key, body, original)
    test_mismatch(gateway, stats_url, key)
    test_bad_keys(gateway, stats_url)
    test_no_key_passes_through(gateway, stats_url)
    if failures:
        print("%d check(s) failed" % len(failures))
        return 1
    print("all end-to-end checks passed")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        print("error talking to the gateway or the service: %r" % (e,), file=sys.stderr)
        sys.exit(1)
