"""Reading a child process's output without ever blocking on it: :func:`pump_lines` copies each
line into a queue from a thread of its own, so the reader can wait with a timeout (a time limit,
a stall check) instead of sitting in ``readline`` on a child that has gone silent."""
from __future__ import annotations

import queue
import threading
from typing import IO, Optional


def pump_lines(stream: IO[str]) -> "queue.Queue[Optional[str]]":
    """Start a daemon thread that puts every line of ``stream`` (ending included) into the
    returned queue as it arrives, then ``None`` at the end of the stream."""
    lines: "queue.Queue[Optional[str]]" = queue.Queue()

    def pump() -> None:
        for raw in stream:
            lines.put(raw)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines
