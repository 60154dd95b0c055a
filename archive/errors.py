"""What goes wrong with the archive, as exceptions a command can catch without loading the archive itself."""

from __future__ import annotations

__all__ = ["ArchiveError", "ArchiveNotFoundError", "ArchiveQueryLimit"]


class ArchiveError(RuntimeError):
    """The archive cannot be opened or used as asked."""


class ArchiveNotFoundError(ArchiveError):
    """No archive at that DSN (and the caller did not ask to create one)."""


class ArchiveQueryLimit(ArchiveError):
    """An ad-hoc query hit one of its limits: ``setting`` (``max_execution_time``,
    ``max_result_rows`` or ``max_memory_usage``, in bytes) at ``limit``."""

    def __init__(self, setting: str, limit: float) -> None:
        what = {"max_execution_time": f"ran longer than {limit:g} s",
                "max_memory_usage": f"needed more than {limit / (1 << 20):g} MiB of memory"}.get(
                    setting, f"returns more than {limit:g} rows")
        super().__init__(f"query stopped: it {what} ({setting})")
        self.setting = setting
        self.limit = limit
