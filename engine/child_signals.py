"""Child processes (worker hosts, TP ranks) ignore terminal signals and obey their parent.

A Ctrl-C in a terminal, or systemd's SIGTERM to the process group, reaches every process of the
group at once. Only the serve process should act on it (drain, then stop its children): a child
that died of it would cut its in-flight streams, and each printed a KeyboardInterrupt traceback.
So children ignore SIGINT and SIGTERM, and leave when their parent tells them or is gone (a
closed control pipe, a TP store that stops answering).

The signals are blocked in the parent's thread while it starts a child, so one that arrives while
the child still imports (seconds with torch) stays pending there, and `ignore_terminal_signals`
discards it before unblocking.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

TERMINAL_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def terminal_signals_blocked() -> Iterator[None]:
    """Around `Process.start()`: the child inherits the blocked mask; this thread gets back its
    own (a signal that came meanwhile is delivered here when the block ends)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, TERMINAL_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_terminal_signals() -> None:
    """First thing in a child: ignore SIGINT/SIGTERM (dropping any pending one), then unblock."""
    for signum in TERMINAL_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, TERMINAL_SIGNALS)
