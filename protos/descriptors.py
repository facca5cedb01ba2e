"""The process's descriptor limit: every connection holds a file descriptor, and so does every open file."""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("veriroll.limits")

DESCRIPTOR_TARGET = 1 << 20
"""The soft limit asked for at start when the hard limit allows it (or is unlimited)."""


def raise_descriptor_limit(target: int = DESCRIPTOR_TARGET) -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` towards its hard limit (at most ``target``), as servers do
    (systemd gives services 1,024 soft against 524,288 hard: a coordinator would run out at about a thousand
    nodes). Returns (soft limit before, soft limit now)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(hard, target)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:  # a sandbox that refuses: keep what there is, and say so
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, want, exc)
            return soft, soft
        return soft, want
    return soft, soft
