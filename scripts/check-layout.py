#!/usr/bin/env python3
"""Checks the repository's layout rules, so they stay true as code lands.

1. Dependency arrows: a part includes headers only from the parts it
   depends on (README, "How it fits together"), directly or through them.
   The master, in particular, never reaches into the data path (transport/,
   client/, store/): what it needs from sockets lives in base/net/.
2. No source file over 800 lines: a file that grows past that has grown a
   second responsibility and is split.

Exits 1 listing every violation, 0 printing a one-line summary.
"""
import os
import re
import sys

# Direct dependencies per part; what a part may include is their closure.
DEPS = {
    "base": [],
    "proto": ["base"],
    "config": ["base"],
    "transport": ["base", "proto", "config"],
    "master": ["base", "proto", "config"],
    "client": ["transport", "proto", "base", "config"],
    "store": ["transport", "client", "base", "config"],
    "engine": ["client", "transport", "base", "config"],
    "python": ["client", "transport", "base", "config"],
    "tools": ["base", "proto", "config", "transport", "master", "client", "store", "engine"],
}
MAX_LINES = 800
SOURCE = (".cc", ".h", ".cu", ".py")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/')


def closure(part):
    seen, todo = set(), [part]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        todo.extend(DEPS.get(p, []))
    return seen


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    problems, files = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        top = rel_dir.split(os.sep)[0] if rel_dir != "." else ""
        if (top.startswith(".") and top != "") or top.startswith("build") or top in ("data", "node_modules"):
            dirnames[:] = []
            continue
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            if not name.endswith(SOURCE):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            files += 1
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.readlines()
            if len(lines) > MAX_LINES:
                problems.append(f"{rel}: {len(lines)} lines (at most {MAX_LINES}: split it along its seams)")
            if top not in DEPS:
                continue  # tests/ and the rest may include every part
            allowed = closure(top)
            for n, line in enumerate(lines, 1):
                m = INCLUDE.match(line)
                if m and m.group(1) in DEPS and m.group(1) not in allowed:
                    problems.append(f"{rel}:{n}: {top}/ includes {m.group(1)}/ ({line.strip()}); "
                                    f"{top} depends on {', '.join(sorted(allowed - {top})) or 'nothing'}")
    if problems:
        print("\n".join(problems))
        print(f"layout: {len(problems)} problem(s) in {files} files")
        return 1
    print(f"layout: {files} source files, none over {MAX_LINES} lines, every include follows the part table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
