#!/usr/bin/env python3
"""Prints the gateway benchmark table from one harness results folder.

usage: bench/summary.py [RESULTS_DIR]   (default: $BENCH_OUT/results/latest, BENCH_OUT=/tmp/idem-bench)

One row per target and scenario: req/s (median of the runs), p50 and p99 (medians), the ratio of req/s
to the nginx plain-proxy row of the same run, p99 minus the upstream's own p99, and the server's RSS
after its load. Stdlib only.
"""
import glob
import json
import os
import statistics
import sys


def load_jsonl(p):
    with open(p) as f:
        return [json.loads(line) for line in f if line.strip()]


def fmt_us(us):
    return "%.0f µs" % us if us < 1000 else "%.2f ms" % (us / 1000)


def main():
    res = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.environ.get("BENCH_OUT", "/tmp/idem-bench"), "results", "latest")
    res = os.path.realpath(res)
    rows = {}
    metas = []
    for m in sorted(glob.glob(os.path.join(res, "wrk", "*.meta.json"))):
        meta = json.load(open(m))
        metas.append(meta)
        for sc in meta["scenarios"].split():
            p = os.path.join(res, "wrk", "%s.%s.jsonl" % (meta["id"], sc))
            if not os.path.exists(p):
                continue
            runs = load_jsonl(p)
            if not runs:
                continue
            rows[(meta["id"], sc)] = {
                "rps": statistics.median(r["requests"] / r["duration_us"] * 1e6 for r in runs),
                "p50": statistics.median(r["lat_p50_us"] for r in runs),
                "p99": statistics.median(r["lat_p99_us"] for r in runs),
                "non2xx": sum(r["err_status"] for r in runs),
                "errors": sum(r["err_connect"] + r["err_read"] + r["err_write"] + r["err_timeout"] for r in runs),
                "foreign": max(r.get("foreign_cores", 0) for r in runs),
                "n": len(runs),
            }
    nginx = rows.get(("nginx-proxy", "unique"), {}).get("rps")
    upstream_p99 = rows.get(("upstream", "unique"), {}).get("p99")

    first = {"upstream": 0, "nginx-proxy": 1}

    def order(meta):
        f = glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets", "*-%s.sh" % meta["id"]))
        return (first.get(meta["id"], 2), 1 if f else 0, os.path.basename(f[0]) if f else meta["id"])

    print("Results: %s" % res)
    print()
    print("| target | scenario | req/s | p50 | p99 | p99 − upstream p99 | × nginx | RSS after | notes |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for meta in sorted(metas, key=order):
        rss = ""
        p = os.path.join(res, "wrk", meta["id"] + ".rss")
        if os.path.exists(p):
            kib = [int(line.split()[1]) for line in open(p) if len(line.split()) == 2]
            if kib:
                rss = "%.0f MiB" % (sum(kib) / 1024)
        first = True
        for sc in meta["scenarios"].split():
            r = rows.get((meta["id"], sc))
            if not r:
                continue
            notes = []
            if r["non2xx"]:
                notes.append("%d non-2xx" % r["non2xx"])
            if r["errors"]:
                notes.append("%d socket errors" % r["errors"])
            if r["foreign"] >= 0.15:
                notes.append("other processes used %.2f cores" % r["foreign"])
            ratio = "%.2f" % (r["rps"] / nginx) if nginx else ""
            added = fmt_us(r["p99"] - upstream_p99) if upstream_p99 is not None and meta["id"] != "upstream" else ""
            print("| %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                meta["name"] if first else "", sc, "{:,.0f}".format(r["rps"]), fmt_us(r["p50"]), fmt_us(r["p99"]),
                added, ratio, rss if first else "", "; ".join(notes)))
            first = False
    pt = os.path.join(res, "powertools.json")
    if os.path.exists(pt):
        try:
            j = json.load(open(pt))
            print()
            print("Powertools idempotent_function + Redis, in-process (calls/s, not HTTP): %s" % json.dumps(
                {k: v for k, v in j.items() if k in ("unique", "repeat")}))
        except (ValueError, OSError):
            pass
    print()
    print("Runs per row: %s. Ratios compare rows of this run only." % ", ".join(
        sorted({str(r["n"]) for r in rows.values()})))


if __name__ == "__main__":
    main()
