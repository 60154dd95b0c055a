"""What tests ask of this machine: a free local port, a condition awaited, the command line here or in a fresh process."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
from typing import Callable

CLI = (sys.executable, "-m", "specwatch.cli")


def free_port() -> int:
    """A local port nothing listens on once this returns (the probe that found it is closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def until(condition: Callable[[], object], patience_s: float = 30.0, interval_s: float = 0.05) -> bool:
    """Poll ``condition`` until it holds (True) or ``patience_s`` has passed (False)."""
    deadline = time.monotonic() + patience_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``specwatch ARGV...`` in this process (arguments made strings): exit code, stdout, stderr."""
    from specwatch.cli import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def specwatch(*argv: str, timeout: float = 600, **run_options) -> subprocess.CompletedProcess:
    """``specwatch ARGV...`` in a fresh interpreter, its output captured as text; options go to `subprocess.run`."""
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=timeout, **run_options)


def fresh_python(code: str, *args, timeout: float = 300, returncode: int = 0) -> str:
    """``code`` (dedented) run by a fresh interpreter with ``args``, which must exit with ``returncode``: its stdout."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == returncode, done.stderr[-3000:]
    return done.stdout


def specwatch_ok(*argv: str, **options) -> subprocess.CompletedProcess:
    """`specwatch` that must exit 0 (the tail of its stderr says why not)."""
    done = specwatch(*argv, **options)
    assert done.returncode == 0, f"specwatch {argv[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}"
    return done
