"""Registries by name (objectives, advantage estimators, tasks, verifiers): one dict each,
whose entries remember where they were registered, so that a name registered twice is an
error naming both places."""

from __future__ import annotations

import sys


def caller(depth: int = 2) -> str:
    """``file:line`` of the code ``depth`` frames above this call's caller."""
    frame = sys._getframe(depth)
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


class Registry(dict):
    """``{name: entry}`` of one ``kind`` ("objective", ...); each entry has a ``where``."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def add(self, name: str, entry) -> None:
        """Adds ``entry`` under ``name``; a name already taken is an error naming both
        registrations."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"register_{self.kind}: name must be a non-empty string, got {name!r}")
        if name in self:
            raise ValueError(
                f"{self.kind} {name!r} is already registered at {self[name].where}; "
                f"registering it again at {entry.where}"
            )
        self[name] = entry
