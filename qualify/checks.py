"""Task checks on one output (JSON schema, tool call, regex, code test, stop reason): each returns
pass or a named failure, and runs the same way on the speculative and the standard path."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import jsonschema

from .dataset import Checks

__all__ = ["CodeRunner", "run_checks", "run_code_test"]

_DEFAULT_CODE_TIMEOUT_S = 20.0

CodeRunner = Callable[[str, str], str | None]
"""(command, output) -> None when the command exits 0 with the output in its file, else why not."""


def run_code_test(command: str, output: str, timeout_s: float = _DEFAULT_CODE_TIMEOUT_S) -> str | None:
    """Run ``command`` with ``{output}`` replaced by a file holding ``output``, in a scratch folder."""
    with tempfile.TemporaryDirectory(prefix="specwatch-check-") as folder:
        path = Path(folder) / "output.py"
        path.write_text(output)
        try:
            # the scratch path holds no quote or space: it can stand inside the command's own quotes
            done = subprocess.run(command.replace("{output}", str(path)), shell=True, cwd=folder,
                                  capture_output=True, timeout=timeout_s, text=True)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout_s:g} s"
    if done.returncode == 0:
        return None
    last = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
    return f"exit {done.returncode}: {last[0][:200]}"


def _parse_json(output: str):
    """The output as JSON: the whole text, else its first {...} or [...] span."""
    text = output.strip()
    try:
        return json.loads(text)
    except ValueError:
        pass
    decoder = json.JSONDecoder()
    for i, char in enumerate(text):
        if char in "{[":
            try:
                return decoder.raw_decode(text, i)[0]
            except ValueError:
                continue
    raise ValueError("no JSON value in the output")


def _json_schema(schema: dict, output: str) -> str | None:
    try:
        jsonschema.validate(_parse_json(output), schema)
    except ValueError as error:
        return str(error)
    except jsonschema.ValidationError as error:
        return f"schema: {error.message[:200]}"
    return None


def _tool_call(schema: dict, output: str) -> str | None:
    try:
        call = _parse_json(output)
    except ValueError as error:
        return str(error)
    if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
        return "not a {name, arguments} object"
    expected = schema.get("x-tool-name")
    if expected is not None and call["name"] != expected:
        return f"tool {call['name']!r}, expected {expected!r}"
    arguments = {k: v for k, v in schema.items() if k != "x-tool-name"}
    try:
        jsonschema.validate(call["arguments"], arguments)
    except jsonschema.ValidationError as error:
        return f"arguments: {error.message[:200]}"
    return None


def run_checks(checks: Checks, output: str, finish_reason: str | None,
               code_runner: CodeRunner = run_code_test) -> dict[str, str | None]:
    """Check name -> None (pass) or why it failed, for every check the request declares.

    >>> run_checks(Checks(regex=r"\\d+", stop_reason="stop"), "it is 42", "length")
    {'regex': None, 'stop_reason': 'finished by length, expected stop'}
    >>> run_checks(Checks(json_schema={"type": "object", "required": ["a"]}), 'x {"a": 1} y', "stop")
    {'json_schema': None}
    """
    results: dict[str, str | None] = {}
    if checks.json_schema is not None:
        results["json_schema"] = _json_schema(checks.json_schema, output)
    if checks.tool_call is not None:
        results["tool_call"] = _tool_call(checks.tool_call, output)
    if checks.regex is not None:
        results["regex"] = None if re.search(checks.regex, output) else f"no match for {checks.regex!r}"
    if checks.code_test is not None:
        results["code_test"] = code_runner(checks.code_test, output)
    if checks.stop_reason is not None:
        results["stop_reason"] = (None if finish_reason == checks.stop_reason
                                  else f"finished by {finish_reason}, expected {checks.stop_reason}")
    return results
