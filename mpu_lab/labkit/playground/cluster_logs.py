"""ipyparallel's cluster log, kept quiet about what is not an error."""
from __future__ import annotations

import logging


class _AlreadyRemoved(logging.Filter):
    """Drops ipyparallel's "Failed to remove <its log file>: [Errno 2] ..." at stop: in
    JupyterLab its server extension and this kernel both clean the cluster's log files, and the
    one that comes second finds the file already gone, which is the goal, not an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Failed to remove") and "Errno 2" in message)


def quiet_about_removed_logs(log) -> None:
    """Filter that message out of ``log`` (a cluster's logger) and of its handlers."""
    if isinstance(log, logging.Logger):
        log.addFilter(_AlreadyRemoved())
        for handler in log.handlers:
            handler.addFilter(_AlreadyRemoved())
