"""A read in a forked child, for a process whose other threads the read's memory cap would starve.

The cap (`unpickle.memory_guard`, RLIMIT_AS) is the whole process's: while a file is read under
it, a server's request threads or a Dask worker's comms fail to allocate too. A forked child has
only the forking thread, so the cap there bounds the read alone; the child hands its model back
as the snapshot cache's own entry format (`npz`: plain numeric arrays, validated on reading, no
pickle), its one-line error and the stream's `last_decline` as JSON. Costs the entry's write and
read: 0.5 s + 0.6 s for the 211 MB model of a 1 GB file (the read itself: 5.8 s), paid only where
other threads run.
"""

from __future__ import annotations

import os
import signal
import tempfile
import warnings
from typing import Any, Callable

import orjson

from snapforensics.errors import SnapError
from snapforensics.snapshot import npz, stream
from snapforensics.snapshot.model import Snapshot


def in_child(read: Callable[[], Snapshot], path: Any, on_killed: str) -> Snapshot:
    """`read()` run in a forked child; its Snapshot, or its SnapError raised here. `on_killed`:
    the message when the child dies without a word (the kernel killed it for memory)."""
    r, w = os.pipe()
    with tempfile.TemporaryFile(prefix="snapforensics-model-") as out:
        with warnings.catch_warnings():  # Python 3.12+ warns of fork with threads: the child
            warnings.simplefilter("ignore", DeprecationWarning)  # runs only this module's code
            pid = os.fork()
        if pid == 0:  # the child: never returns
            code, said = 1, dict[str, object]()
            try:
                os.close(r)
                snap = read()
                npz.save(snap, out)
                out.flush()
                code = 0
            except SnapError as e:
                said = {"error": str(e), "code": e.exit_code}
            except BaseException as e:  # noqa: BLE001 - a bug: said in one line, not lost
                said = {"error": f"{path}: {type(e).__name__}: {e}", "code": 1}
            finally:
                try:
                    os.write(w, orjson.dumps(dict(said, decline=stream.last_decline)))
                finally:
                    os._exit(code)
        os.close(w)
        reaped = False
        try:
            with os.fdopen(r, "rb") as pipe:
                message = orjson.loads(pipe.read(1 << 16) or b"{}")
            _, status = os.waitpid(pid, 0)
            reaped = True
        finally:
            if not reaped:  # interrupted (Ctrl-C): the child goes with us
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        stream.last_decline = str(message.get("decline", ""))  # as an in-process read leaves it
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            out.seek(0)
            return npz.read(out, str(path))
    if "error" in message:
        raise SnapError(str(message["error"]), int(message["code"]))
    raise SnapError(on_killed)
