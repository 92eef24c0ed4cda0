#!/usr/bin/env python3
"""Module dependency graph of a crate's src/ (top-level modules, from `crate::` paths), and its
import circles.

    python3 scripts/modgraph.py crates/distcomm/src [--dot]

An edge a -> b means a file of module a names `crate::b` (or a `super::` path of a's own
children is ignored). Prints each circle (strongly connected component of more than one module).
"""
import os
import re
import sys


def top(path, root):
    rel = os.path.relpath(path, root)
    first = rel.split(os.sep)[0]
    return first[:-3] if first.endswith(".rs") else first


def main():
    root = sys.argv[1]
    # Names the crate root re-exports (`pub use module::{A, B}`) count as their module.
    reexports = {}
    for lib in ("lib.rs", "main.rs"):
        path = os.path.join(root, lib)
        if os.path.exists(path):
            for mod, names in re.findall(r"pub use (\w+)::\{?([\w, ]+)\}?;", open(path).read()):
                for n in names.split(","):
                    reexports[n.strip()] = mod
    edges = {}
    for d, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".rs"):
                continue
            p = os.path.join(d, f)
            m = top(p, root)
            if m in ("lib", "main"):
                continue
            src = open(p).read()
            # Doc comments and comments do not count.
            src = re.sub(r"//[^\n]*", "", src)
            for dep in re.findall(r"\bcrate::(\w+)", src):
                dep = reexports.get(dep, dep)
                if dep != m:
                    edges.setdefault(m, set()).add(dep)
    nodes = sorted(set(edges) | {d for v in edges.values() for d in v})
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def strong(v, counter=[0]):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in nodes:
        if v not in index:
            strong(v)
    if "--dot" in sys.argv:
        for a in sorted(edges):
            for b in sorted(edges[a]):
                print(f"{a} -> {b}")
    for c in sccs:
        print("circle:", " <-> ".join(c))
    print(f"{len(nodes)} modules, {sum(len(v) for v in edges.values())} edges, {len(sccs)} circles")
    return 1 if sccs else 0


if __name__ == "__main__":
    sys.exit(main())
