"""raise_open_files_limit: let a server hold as many connections as the host allows.

Every client connection is a file descriptor, and the usual soft limit is 1024. Past it the API
cannot accept, and the kernel resets the connections it refuses: 1500 requests sent at once to
`redjax serve` under `ulimit -n 1024` (session 49) gave 427 "connection reset by peer", with nothing
in the server's log; with the soft limit raised (1024 soft, a higher hard one) the same run gave 1164
answers and 336 clean 429s (the queue's limit of 1024), no resets.
The soft limit goes up to the hard one, which only the administrator sets.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("redjax.api")
UNLIMITED_HARD = 1 << 16  # the soft limit to take when the hard one is unlimited


def raise_open_files_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_HARD if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open files limit from %d: %s", soft, exc)
            return soft
        log.info("open files limit raised from %d to %d (one per connection)", soft, target)
        return target
    return soft
