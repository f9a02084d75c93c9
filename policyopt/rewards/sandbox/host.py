"""What this host lets a sandbox use: root (throw-away uids), network and mount namespaces."""

import functools
import os
import random
import shutil
import subprocess

# Unprivileged uids used when the scorer runs as root (unlikely to belong to anyone).
SANDBOX_UIDS = range(2_000_000, 2_100_000)


@functools.cache
def is_root() -> bool:
    """Whether the scorer runs as root (and so can give each sandbox a uid of its own)."""
    return os.geteuid() == 0


def sandbox_uids(count: int) -> list[int]:
    """``count`` distinct throw-away uids when the scorer is root, else -1 each."""
    return random.sample(SANDBOX_UIDS, count) if is_root() else [-1] * count


@functools.cache
def unshare_prefix() -> tuple[str, ...]:
    """``("unshare", "--net", "--")`` when creating a network namespace works here."""
    unshare = shutil.which("unshare") or (
        "/usr/bin/unshare" if os.path.exists("/usr/bin/unshare") else None
    )
    if unshare is None:
        return ()
    for flags in (("--net",), ("--net", "--map-root-user")):
        try:
            probe = subprocess.run(
                [unshare, *flags, "--", "true"], capture_output=True, timeout=10, env={}
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return (unshare, *flags, "--")
    return ()


@functools.cache
def jail_prefix() -> tuple[str, ...]:
    """``("unshare", "--net", "--mount", "--")`` when the scorer is root and that works."""
    net = unshare_prefix()
    if not is_root() or not net or "--map-root-user" in net:
        return ()
    probe = subprocess.run(
        [net[0], "--net", "--mount", "--", "true"], capture_output=True, timeout=10, env={}
    )
    return (net[0], "--net", "--mount", "--") if probe.returncode == 0 else ()


def interpreter_prefix(python: str) -> str:
    """The installation folder of an interpreter outside /usr (``/opt/python3.11`` for
    ``/opt/python3.11/bin/python3``), which the jail must hold too; "" under /usr."""
    real = os.path.realpath(python)
    return "" if real.startswith("/usr/") else os.path.dirname(os.path.dirname(real))
