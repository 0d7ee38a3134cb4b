#!/usr/bin/env python3
"""Per-request costs by function from two callgrind runs of bench/instructions.sh: (M run - N run) / (M - N).

usage: callgrind_diff.py CASE.N.out CASE.M.out [TOP]   (N and M are read from the file names)
Prints the TOP (default 30) functions by self cost and by inclusive cost, in instructions per request,
as callgrind_annotate --inclusive=no / --inclusive=yes see them (inlined code counts in its caller).
Start-up and the warm-up cancel out, as in bench/instructions.sh's table.
"""
import re
import subprocess
import sys

LINE = re.compile(r"^\s*([\d,]+)\s+\([\s\d.]+%\)\s+(.*?)(?:\s+\[[^\]]*\])?\s*$")
HASH = re.compile(r"::h[0-9a-f]{16}\b")


def costs(path, inclusive):
    out = subprocess.run(["callgrind_annotate", "--threshold=100", "--inclusive=" + inclusive, path],
                         check=True, capture_output=True, text=True).stdout
    res, total = {}, 0
    for line in out.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        n, name = int(m.group(1).replace(",", "")), HASH.sub("", m.group(2))
        if name == "PROGRAM TOTALS":
            total = n
            continue
        res[name] = res.get(name, 0) + n
    return res, total


def short(name, width=150):
    name = re.sub(r"^\?\?\?:", "", name)
    return name if len(name) <= width else name[: width - 1] + "…"


def main():
    fn, fm = sys.argv[1], sys.argv[2]
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    n, m = int(fn.rsplit(".", 2)[-2]), int(fm.rsplit(".", 2)[-2])
    for inclusive in ("no", "yes"):
        a, ta = costs(fn, inclusive)
        b, tb = costs(fm, inclusive)
        per = (tb - ta) / (m - n)
        d = {k: (b.get(k, 0) - a.get(k, 0)) / (m - n) for k in set(a) | set(b)}
        print("## %s cost per request (%s): total %.0f instructions/request\n"
              % ("inclusive" if inclusive == "yes" else "self", fm.rsplit("/", 1)[-1].rsplit(".", 2)[0], per))
        noise = sum(v for k, v in d.items() if "quanta::Clock::new" in k) if inclusive == "yes" else None
        if noise:
            print("(quanta::Clock::new, a time-bound clock calibration at start-up, differs between the runs by %.0f "
                  "per request here; its self cost is under once_cell's OnceCell::initialize and clock_gettime. "
                  "bench/instructions.sh leaves it out of its table.)\n" % noise)
        print("| instr/req | % | function |")
        print("|---:|---:|---|")
        for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]:
            print("| %.0f | %.1f | `%s` |" % (v, 100 * v / per if per else 0, short(k).replace("|", "\\|")))
        print()


if __name__ == "__main__":
    main()
