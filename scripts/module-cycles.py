#!/usr/bin/env python3
"""Checks that no two modules of one crate import each other.

    python3 scripts/module-cycles.py [--graph]

For every crate under crates/ and examples/, each top-level module (src/foo.rs
or src/foo/**) is a node; a reference `crate::bar::...` (in a `use` or in an
expression, braces expanded) from a file of module `foo` is an edge foo -> bar.
Unit tests (`#[cfg(test)] mod tests { ... }`) are left out. A name
the crate root re-exports (`pub use bar::Item;` in lib.rs) counts as an
edge to `bar` too. Items defined in lib.rs itself belong to no module, and
references inside one module (its own submodules, `super::`) are not edges.

Exit status 1, and each pair printed, when some module A uses B and B uses A
(directly); 0 otherwise. `--graph` also prints every crate's edges.
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_comments(text):
    """The code without comments and without `#[cfg(test)] mod name { ... }` blocks."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    while True:
        m = re.search(r"#\[cfg\(test\)\]\s*mod\s+" + IDENT + r"\s*\{", text)
        if not m:
            return text
        _, end = brace_group(text, m.end() - 1)
        text = text[: m.start()] + text[end + 1 :]


def brace_group(text, start):
    """The text inside the brace that opens at text[start], and the end index."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i
    return text[start + 1 :], len(text)


def split_top(group):
    """Splits `a::b, c::{d, e}, f` at the commas outside braces."""
    parts, depth, cur = [], 0, []
    for ch in group:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def first_names(text):
    """The first path segment of every `crate::` reference in text."""
    names = []
    for m in re.finditer(r"\bcrate::", text):
        rest = text[m.end() :].lstrip()
        if rest.startswith("{"):
            start = m.end() + (len(text[m.end() :]) - len(rest))
            group, _ = brace_group(text, start)
            for part in split_top(group):
                n = re.match(IDENT, part)
                if n:
                    names.append(n.group(0))
        else:
            n = re.match(IDENT, rest)
            if n:
                names.append(n.group(0))
    return names


def root_reexports(lib_text, modules):
    """Names the crate root re-exports, mapped to the module they come from."""
    out = {}
    for m in re.finditer(r"\bpub\s+use\s+(?:crate::|self::)?(" + IDENT + r")::", lib_text):
        module = m.group(1)
        if module not in modules:
            continue
        rest = lib_text[m.end() :]
        stmt = rest[: rest.find(";")]
        for n in re.findall(IDENT, stmt):
            out.setdefault(n, module)
    return out


def crate_edges(src):
    files = sorted(src.rglob("*.rs"))
    modules = {}
    for f in files:
        rel = f.relative_to(src)
        if rel.parts[0] in ("lib.rs", "main.rs"):
            continue
        name = rel.parts[0][:-3] if rel.parts[0].endswith(".rs") else rel.parts[0]
        modules.setdefault(name, []).append(f)
    lib = src / "lib.rs"
    if not lib.exists():
        lib = src / "main.rs"
    reexports = root_reexports(strip_comments(lib.read_text()), modules) if lib.exists() else {}
    edges = {}
    for module, paths in modules.items():
        for f in paths:
            for n in first_names(strip_comments(f.read_text())):
                target = n if n in modules else reexports.get(n)
                if target and target != module:
                    edges.setdefault(module, set()).add(target)
    return edges


def main():
    args = sys.argv[1:]
    if any(a in ("-h", "--help") for a in args) or any(a != "--graph" for a in args):
        print(__doc__.strip())
        return 0 if all(a in ("-h", "--help", "--graph") for a in args) else 2
    graph = "--graph" in args
    cycles = []
    crates = sorted(p for p in (ROOT / "crates").glob("*/src")) + sorted(
        p for p in (ROOT / "examples").glob("*/src")
    )
    for src in crates:
        name = src.parent.name
        edges = crate_edges(src)
        if graph:
            for a in sorted(edges):
                print(f"{name}: {a} -> {', '.join(sorted(edges[a]))}")
        for a in sorted(edges):
            for b in sorted(edges[a]):
                if a < b and a in edges.get(b, ()):
                    cycles.append(f"{name}: {a} <-> {b}")
    if cycles:
        print("modules that import each other:")
        for c in cycles:
            print("  " + c)
        return 1
    print(f"module-cycles: no two modules import each other ({len(crates)} crates)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `--graph | head`
        sys.stderr.close()
        sys.exit(0)
