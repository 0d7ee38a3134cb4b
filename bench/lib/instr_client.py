#!/usr/bin/env python3
"""The client of bench/instructions.sh: an exact number of keep-alive POST /orders requests.

usage: instr_client.py PORT MODE NONCE WARMUP COUNT [CONNS]
  MODE unique  a new Idempotency-Key per request (every request a first execution)
       replay  one key, sent once before the warm-up, then repeated with the same body
       nokey   no Idempotency-Key header (the gateway's pass-through)
       plain   like unique (for a server that ignores the header, e.g. nginx)
The warm-up requests (WARMUP of them, same mode) come first, then COUNT requests, spread round-robin
over CONNS keep-alive connections (default 1), one request at a time. Every status must be 2xx;
failures are counted, printed, and make the exit status 1. Keys have a fixed length, so every
request costs the same to parse.
"""
import http.client
import sys

BODY = b'{"item":"widget","qty":1,"price_cents":1999}'  # 45 bytes, as the harness's wrk/post.lua


def main():
    port, mode, nonce = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    warmup, count = int(sys.argv[4]), int(sys.argv[5])
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=120)
             for _ in range(int(sys.argv[6]) if len(sys.argv) > 6 else 1)]
    failures, seq = [], [0]

    def send(key):
        conn = conns[seq[0] % len(conns)]
        seq[0] += 1
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Idempotency-Key"] = key
        try:
            conn.request("POST", "/orders", body=BODY, headers=headers)
            resp = conn.getresponse()
            resp.read()
            if not 200 <= resp.status < 300:
                failures.append("%s -> %d" % (key, resp.status))
        except (OSError, http.client.HTTPException) as e:
            failures.append("%s -> %r" % (key, e))
            conn.close()

    def key(i):
        if mode in ("unique", "plain"):
            return "u-%s-%08d" % (nonce, i)
        if mode == "replay":
            return "r-%s-%08d" % (nonce, 0)
        return None

    if mode == "replay":
        send(key(0))  # the one first execution; everything after it is a replay
    for i in range(warmup + count):
        send(key(i))
    for c in conns:
        c.close()
    if failures:
        print("%d of %d requests failed, e.g. %s" % (len(failures), seq[0], "; ".join(failures[:5])), file=sys.stderr)
        sys.exit(1)
    print(seq[0])


if __name__ == "__main__":
    main()
