"""Clients for an archive location: the per-process chDB engine, or a ClickHouse server,
and the one way an Arrow table is inserted into either."""

from __future__ import annotations

import fcntl
import functools
import os
import re
import threading
from typing import Any, Callable, Mapping

from specwatch.archive.dsn import ArchiveLocation
from specwatch.archive.errors import ArchiveError, ArchiveNotFoundError

__all__ = ["ArrowInsert", "connect", "server_insert"]

ArrowInsert = Callable[[str, Any, Mapping[str, Any]], None]
"""Inserts an Arrow table (columns named as in the table) into ``database.table``, with settings."""

_USER_ENV = "SPECWATCH_CLICKHOUSE_USER"
_PASSWORD_ENV = "SPECWATCH_CLICKHOUSE_PASSWORD"


def connect(location: ArchiveLocation, password: str | None, *, create: bool,
            environ: Mapping[str, str]) -> tuple[Any, ArrowInsert, Callable[[], None]]:
    """A clickhouse-connect client for ``location``, how Arrow tables are inserted there,
    and the function that releases both."""
    if location.engine == "chdb":
        # Checked before the engine starts: opening a directory makes chDB lay out
        # its store there, which a read-only command must not do to a wrong path.
        if not create and not os.path.isdir(os.path.join(location.path, "metadata")):
            raise ArchiveNotFoundError(f"no archive at {location.label}")
        if create:
            os.makedirs(location.path, exist_ok=True)
        client, engine, lock = _CHDB_CLIENTS.acquire(location.path)
        return client, functools.partial(_chdb_insert, engine, lock), functools.partial(_CHDB_CLIENTS.release, client)
    import clickhouse_connect  # heavy; only archive users pay for it

    username = location.username or environ.get(_USER_ENV) or "default"
    if password is None:
        password = environ.get(_PASSWORD_ENV, "")
    try:
        client = clickhouse_connect.get_client(
            host=location.host, port=location.port, username=username, password=password,
            secure=location.secure)
    except Exception as exc:
        # The driver's message names host and user, never the password; the socket's own
        # reason ("[Errno 111] Connection refused") says it in one line when it is there.
        reason = re.search(r"\[Errno -?\d+\][^'\")]*", str(exc))
        raise ArchiveError(f"cannot connect to the archive at {location.label}: "
                           f"{reason.group(0).strip() if reason else exc}") from exc
    return client, functools.partial(server_insert, client), client.close


def server_insert(client: Any, table: str, data: Any, settings: Mapping[str, Any]) -> None:
    """An Arrow table into a server over HTTP (also any clickhouse-connect client passed in)."""
    client.insert_arrow(table, data, settings=dict(settings))


def _chdb_insert(engine: Any, lock: threading.Lock, table: str, data: Any, settings: Mapping[str, Any]) -> None:
    """An Arrow table into the chDB engine in memory: ``Python(data)`` reads its buffers where
    they are (clickhouse-connect's chDB ``insert_arrow`` goes through a file)."""
    from clickhouse_connect.driver.exceptions import DatabaseError

    names = ", ".join(data.schema.names)
    clause = ", ".join(f"{name} = {int(value)}" for name, value in settings.items())  # integer settings only
    try:
        with lock:  # one statement at a time on the shared handle, as clickhouse-connect does on its own
            engine.query(f"INSERT INTO {table} ({names}) {'SETTINGS ' + clause + ' ' if clause else ''}"
                         "SELECT * FROM Python(data)")
    except RuntimeError as exc:  # what the engine refuses, as the client would have raised it
        raise DatabaseError(str(exc).strip()) from exc


class _ChdbClients:
    """The per-process chDB client: chDB hosts one engine path per process, so archives on that
    path share it; released with the last user, after which another path may be opened."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._path: str | None = None
        self._client: Any = None
        self._engine: Any = None
        self._engine_lock = threading.Lock()
        self._users = 0

    def acquire(self, path: str) -> tuple[Any, Any, threading.Lock]:
        """The clickhouse-connect client on ``path``, a chDB connection of its own for inserts and
        the lock every insert on that connection takes."""
        path = os.path.realpath(path)
        with self._lock:
            if self._client is not None:
                if path != self._path:
                    raise ArchiveError(
                        f"chDB hosts one archive per process: {self._path} is open here, so "
                        f"{path} cannot be; close the other archive or use another process")
                self._users += 1
                return self._client, self._engine, self._engine_lock
            import clickhouse_connect  # heavy; only archive users pay for it

            # Both asked first: the engine would print its own error straight to stderr.
            holder = _chdb_holder(path)
            if holder:
                raise ArchiveError(_in_use(path, holder))
            try:
                os.close(os.open(os.path.join(path, "status"), os.O_WRONLY | os.O_CREAT, 0o644))
            except OSError as exc:
                raise ArchiveError(f"the chDB archive at {path} cannot be written: "
                                   f"{exc.strerror or exc} ({exc.filename})") from exc
            try:
                client = clickhouse_connect.get_client(interface="chdb", path=path)
            except Exception as exc:
                holder = _chdb_holder(path)
                if holder:
                    # chDB's own message here is an empty "Error initializing EmbeddedServer".
                    raise ArchiveError(_in_use(path, holder)) from exc
                raise ArchiveError(f"cannot open the chDB archive at {path}: {exc}") from exc
            import chdb

            # A second handle on the engine the client just started (chDB allows many per path).
            try:
                engine = chdb.connect(path)
            except Exception as exc:
                client.close()
                raise ArchiveError(f"cannot open the chDB archive at {path}: {exc}") from exc
            self._path, self._client, self._engine, self._users = path, client, engine, 1
            return client, engine, self._engine_lock

    def release(self, client: Any) -> None:
        with self._lock:
            if client is not self._client:
                return
            self._users -= 1
            if self._users == 0:
                engine, self._client, self._engine, self._path = self._engine, None, None, None
                engine.close()  # every handle closed, or the engine keeps the path
                client.close()


def _in_use(path: str, holder: str) -> str:
    return (f"the chDB archive at {path} is in use by process {holder}: a chDB directory opens in one "
            "process at a time (use a ClickHouse server DSN to read while the pipeline writes)")


def _chdb_holder(path: str) -> str | None:
    """The pid of another running engine that holds the directory's lock file, if any."""
    try:
        with open(os.path.join(path, "status"), encoding="utf-8", errors="replace") as status:
            text = status.read(4096)
            try:  # the engine holds an exclusive flock on it while it runs
                fcntl.flock(status.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(status.fileno(), fcntl.LOCK_UN)
                return None
            except OSError:
                pass  # held (BlockingIOError), or no flock here: the pid alone has to tell
    except OSError:
        return None
    found = re.search(r"PID:\s*(\d+)", text)
    if not found or int(found.group(1)) == os.getpid():
        return None
    try:
        os.kill(int(found.group(1)), 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return None  # a stale file left by an engine that crashed
    except PermissionError:
        pass
    return found.group(1)


# The one piece of module-level mutable state: chDB's one-engine-per-process rule
# makes the engine a process resource, so its clients are shared per process.
_CHDB_CLIENTS = _ChdbClients()
