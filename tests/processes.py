"""Process-tree helpers shared by the tests' subprocess scripts (importable by them: they run
with the repository on PYTHONPATH)."""

import os


def descendants(pid: int | None = None) -> set[int]:
    """The live (not zombie) processes below ``pid`` (default: this process), from /proc."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] not in "ZX":
                parents[int(name)] = int(fields[1])
    found, frontier = set(), {os.getpid() if pid is None else pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found
