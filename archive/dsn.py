"""Where the archive lives: DSN parsing, the default DSN, and DSNs as they may be shown (standard
library only, so commands check ``--archive`` without loading the archive)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Mapping
from urllib.parse import unquote, urlsplit

__all__ = ["ARCHIVE_ENV", "DEFAULT_ARCHIVE_DSN", "DEFAULT_DATABASE", "ArchiveDsn", "ArchiveLocation",
           "archive_dsn", "check_database_name", "parse_archive_dsn"]

ARCHIVE_ENV = "SPECWATCH_ARCHIVE"
DEFAULT_ARCHIVE_DSN = "chdb://specwatch-data/archive"
DEFAULT_DATABASE = "specwatch"
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def archive_dsn(environ: Mapping[str, str] | None = None) -> str:
    """The archive DSN to use when none is given: ``$SPECWATCH_ARCHIVE`` or the default.

    >>> archive_dsn({})
    'chdb://specwatch-data/archive'
    >>> archive_dsn({"SPECWATCH_ARCHIVE": "chdb:///var/lib/specwatch"})
    'chdb:///var/lib/specwatch'
    """
    environ = os.environ if environ is None else environ
    return environ.get(ARCHIVE_ENV) or DEFAULT_ARCHIVE_DSN


def check_database_name(database: str) -> str:
    """``database`` if it is a plain identifier (it is written into SQL); ValueError otherwise."""
    if not _IDENTIFIER.fullmatch(database):
        raise ValueError(f"archive database name {database!r} must be a plain identifier")
    return database


@dataclass(frozen=True)
class ArchiveLocation:
    """A parsed archive DSN. Holds no password: that goes straight to the client."""

    engine: str  # "chdb" or "server"
    path: str = ""
    host: str = ""
    port: int = 0
    secure: bool = False
    database: str = DEFAULT_DATABASE
    username: str = ""

    @property
    def label(self) -> str:
        """The DSN as it may appear in logs and messages (never with credentials)."""
        if self.engine == "chdb":
            return f"chdb://{self.path}"
        scheme = "https" if self.secure else "http"
        return f"{scheme}://{self.host}:{self.port}/{self.database}"


def parse_archive_dsn(dsn: str, cwd: str | None = None) -> tuple[ArchiveLocation, str | None]:
    """Split an archive DSN into a location and the password it carries, if any; ValueError saying
    why a DSN names no archive (nothing is opened: commands check ``--archive`` with it first).

    >>> parse_archive_dsn("chdb://specwatch-data/archive", cwd="/srv")[0].path
    '/srv/specwatch-data/archive'
    >>> parse_archive_dsn("chdb:///var/lib/specwatch")[0].path
    '/var/lib/specwatch'
    >>> loc, password = parse_archive_dsn("https://ops:s%40cret@ch.internal:8443/postmortems")
    >>> loc.label, loc.username, password
    ('https://ch.internal:8443/postmortems', 'ops', 's@cret')
    >>> parse_archive_dsn("http://ch.internal")[0].label
    'http://ch.internal:8123/specwatch'
    >>> parse_archive_dsn("https://[::1")
    Traceback (most recent call last):
    ...
    ValueError: archive DSN 'https://[::1' is not a URL (Invalid IPv6 URL)
    """
    scheme, sep, rest = dsn.partition("://")
    scheme = scheme.lower()
    if not sep or not rest:
        raise ValueError(f"archive DSN {_redact(dsn)!r} is not chdb:///abs/path, chdb://relative/path "
                         "or http(s)://[user[:password]@]host[:port][/database]")
    if scheme == "chdb":
        # chdb:///abs is absolute; chdb://rel/dir is relative to the working directory
        # (clickhouse-connect alone would read the first segment as a location and the
        # rest as a database name).
        raw = unquote(rest.split("?", 1)[0])
        path = raw if raw.startswith("/") else os.path.join(cwd or os.getcwd(), raw)
        return ArchiveLocation("chdb", path=os.path.normpath(path)), None
    if scheme not in ("http", "https"):
        raise ValueError(f"archive DSN scheme {scheme!r} is not one of chdb, http, https")
    try:
        parts = urlsplit(dsn)
        parts.port  # noqa: B018 - parsed lazily; a port that is not a number raises here
    except ValueError as error:  # "Invalid IPv6 URL", "Port out of range 0-65535"
        raise ValueError(f"archive DSN {_redact(dsn)!r} is not a URL ({error})") from None
    if not parts.hostname:
        raise ValueError(f"archive DSN {_redact(dsn)!r} has no host")
    secure = scheme == "https"
    database = check_database_name(unquote(parts.path.strip("/")) or DEFAULT_DATABASE)
    location = ArchiveLocation("server", host=parts.hostname, port=parts.port or (8443 if secure else 8123),
                               secure=secure, database=database, username=unquote(parts.username or ""))
    return location, unquote(parts.password) if parts.password is not None else None


@dataclass(frozen=True)
class ArchiveDsn:
    """An archive DSN parsed once (where the command line checks it) and passed on from there:
    the location, and the password it carried, which is never shown.

    >>> dsn = ArchiveDsn.parse("https://ops:s%40cret@ch.internal/postmortems")
    >>> dsn.label, dsn.location.engine, "s@cret" in repr(dsn)
    ('https://ch.internal:8443/postmortems', 'server', False)
    """

    location: ArchiveLocation
    password: str | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, dsn: str, cwd: str | None = None) -> "ArchiveDsn":
        """`parse_archive_dsn`'s location and password as one value; ValueError as it raises."""
        return cls(*parse_archive_dsn(dsn, cwd))

    @classmethod
    def of(cls, dsn: "ArchiveDsn | str | None", environ: Mapping[str, str] | None = None) -> "ArchiveDsn":
        """``dsn`` as parsed, parsing it only if it is still text (None: `archive_dsn`)."""
        return dsn if isinstance(dsn, ArchiveDsn) else cls.parse(dsn or archive_dsn(environ))

    @property
    def label(self) -> str:
        return self.location.label


def _redact(dsn: str) -> str:
    """A DSN with any password removed, for error messages.

    >>> _redact("http://ops:hunter2@ch:8123/db")
    'http://ops:***@ch:8123/db'
    """
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", dsn)
