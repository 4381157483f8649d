"""A failed Orbax save closes its asyncio loop while tensorstore writes are still in flight; each
of them then reports ``Event loop is closed`` as an unraisable exception (hundreds of
tracebacks on a full disk, before the one disk-full line). ``Checkpointer`` installs a
``sys.unraisablehook`` filter for exactly that; anything else still reaches the previous hook.

Run in a subprocess: pytest wraps ``sys.unraisablehook`` itself during a test.
"""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = r"""
import asyncio, gc, sys, threading
import tensorstore as ts
from jax_rl.checkpoint import _install_closed_loop_hook
_install_closed_loop_hook()

promise, future = ts.Promise.new()       # one write still in flight
loop = asyncio.new_event_loop()

async def save():
    async def write():
        await future
    asyncio.ensure_future(write())
    await asyncio.sleep(0.01)
    raise OSError(28, "No space left on device")   # the first write failed

try:
    loop.run_until_complete(save())
except OSError:
    pass
loop.close()
t = threading.Thread(target=lambda: promise.set_result(1))   # the late write completes
t.start(); t.join()
print("DROPPED", sys.unraisablehook.dropped)

class Bad:                                 # an unrelated unraisable exception is still shown
    def __del__(self):
        raise ValueError("unrelated failure in __del__")
Bad(); gc.collect()
"""


def test_closed_loop_tracebacks_dropped_others_kept():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr
    assert "DROPPED 1" in r.stdout
    assert "Event loop is closed" not in r.stderr, r.stderr
    assert "unrelated failure in __del__" in r.stderr, r.stderr
