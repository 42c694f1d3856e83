"""Keep the garbage collector's full passes off the serving path.

A process that has imported torch and transformers holds a few million objects that live as long
as it does. CPython's oldest-generation collection walks all of them: 130-200 ms in the router
process on the 2-core machine, a pause that every request and token in flight waits through (in
benchmarks/router_load.py it was the whole of the 200-300 ms worst case per token). Once a server has
started, `gc.freeze()` moves everything alive into a permanent generation that collections skip;
what is made afterwards is collected as usual.

Call `freeze_startup_heap()` where a process has finished starting a long-lived server (a worker
process, a rank, the router's host) and `unfreeze_heap()` when a process that outlives the
server shuts it down, so that start-up objects it dropped can be collected again.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    gc.collect()
    gc.freeze()


def unfreeze_heap() -> None:
    gc.unfreeze()
