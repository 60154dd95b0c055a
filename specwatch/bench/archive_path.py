"""The archive section of `specwatch bench`: window-stats rows from stage 2 into embedded chDB.

Every path starts from the same stage-2 rows (`SliceOutput.windows`, copied forward in time
so that each copy is a slice of its own) and ends in the same table, in one run:

- the sink (`ArchiveSink`, one slice at a time, as `run`, `replay` and `demo` hand it over):
  insert columns built from the rows in one pass, handed to chDB in memory, at its default
  batch;
- the row path it replaced: a dict per row, `window_stats_table`, and clickhouse-connect's
  `insert_arrow`, which on chDB writes an Arrow file and inserts it ``FROM INFILE``, at the
  sink's batch of then (5,000 rows);
- the writer alone, every row in one call (`Archive.write_window_rows`);
- the engine's insert of one ready Arrow table by each transport there is (in memory
  through ``Python()``, an Arrow stream pushed through chDB's streaming insert, the file
  round trip), and the two column builders without any insert;
- one INSERT per row.

Rates are rows per wall second; ``*_cpu`` rates are rows per CPU second of the process,
the engine's threads included.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["run_archive_bench"]

# The sink's batch before its rows became columns: the row path writes with it.
_ROW_PATH_BATCH = 5000


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """Wall and CPU seconds of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, max(time.process_time() - cpu, 1e-9)


def run_archive_bench(template: list, rows: int, naive_rows: int) -> dict:
    """Each path over ``rows`` window rows made from ``template`` (`WindowRow`s of one
    pipeline run, in slice order), in one run; see the module docstring."""
    import chdb
    import clickhouse_connect
    import pyarrow as pa

    from specwatch.archive.rows import window_rows_table, window_stats_table
    from specwatch.archive.sink import ArchiveSink
    from specwatch.archive.store import Archive
    from specwatch.schemas.outputs import SliceOutput

    span = max(row.ts for row in template) - min(row.ts for row in template) + 1.0

    def copies(shift: float) -> list:  # distinct slices: each copy of the template moves on in time
        return [template[i % len(template)]._replace(ts=template[i % len(template)].ts + shift
                                                     + span * (i // len(template))) for i in range(rows)]

    def slices(window_rows: list) -> list[SliceOutput]:
        by_end: dict[float, list] = {}
        for row in window_rows:
            by_end.setdefault(row.ts, []).append(row)
        return [SliceOutput(slice_index=i, slice_end=end, windows=part) for i, (end, part) in enumerate(by_end.items())]

    sink_outputs, row_outputs = slices(copies(0.0)), slices(copies(1e7))
    direct = copies(2e7)
    ready = window_rows_table(copies(3e7), 0)
    names = ", ".join(ready.schema.names)
    report: dict[str, Any] = {"rows": rows, "slices": len(sink_outputs),
                              "rows_per_slice": rows / len(sink_outputs), "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.realpath(f"{tmp}/archive")
        archive = Archive.open(f"chdb://{path}")
        # Handles of their own on the same engine, for the paths the archive no longer takes.
        client = clickhouse_connect.get_client(interface="chdb", path=path)
        engine = chdb.connect(path)
        try:
            def through_sink() -> None:
                sink = ArchiveSink(archive, spool=Path(tmp) / "spool")  # its own batch, as every command runs it
                for output in sink_outputs:
                    sink(output)
                sink.close()
                if sink.stats()["spooled"] or sink.stats()["dropped_entries"]:
                    raise RuntimeError(f"the archive refused rows during the bench: {sink.stats()}")

            legacy = Archive(client)  # a client passed in: dict rows, insert_arrow's file round trip

            def through_rows() -> None:
                pending: list[dict] = []
                for output in row_outputs:
                    pending.extend(output.window_rows)
                    if len(pending) >= _ROW_PATH_BATCH:
                        legacy.write_window_stats(pending)
                        pending = []
                legacy.write_window_stats(pending)

            def by_memory(data: pa.Table) -> None:
                engine.query(f"INSERT INTO specwatch.window_stats ({names}) SETTINGS optimize_on_insert = 0 "
                             "SELECT * FROM Python(data)")

            def by_stream(data: pa.Table) -> None:
                sink = pa.BufferOutputStream()
                with pa.ipc.new_stream(sink, data.schema) as writer:
                    writer.write_table(data)
                with engine.send_insert(f"INSERT INTO specwatch.window_stats ({names}) "
                                        "SETTINGS optimize_on_insert = 0", "ArrowStream") as insert:
                    insert.append(sink.getvalue().to_pybytes())
                    insert.finish()

            def by_file(data: pa.Table) -> None:
                client.insert_arrow("specwatch.window_stats", data, settings={"optimize_on_insert": 0})

            measured = {"sink": through_sink, "row_path": through_rows,
                        "direct": lambda: archive.write_window_rows(direct)}
            for name, fn in measured.items():
                wall, cpu = _timed(fn)
                report[f"{name}_rows_per_s"], report[f"{name}_rows_per_s_cpu"] = rows / wall, rows / cpu
            dicts = [row.as_dict() for row in direct]
            for name, fn in (("columns", lambda: window_rows_table(direct, 0)),
                             ("dicts", lambda: window_stats_table(dicts, 0))):
                wall, cpu = _timed(fn)
                report[f"build_{name}_rows_per_s"] = rows / cpu
            shift = 0.0
            for name, insert in (("memory", by_memory), ("stream", by_stream), ("file", by_file)):
                shift += 1e7  # each transport writes slices of its own
                data = ready.set_column(0, "ts", pa.compute.add(ready.column("ts"), shift))
                wall, cpu = _timed(lambda: insert(data))
                report[f"insert_{name}_rows_per_s"], report[f"insert_{name}_rows_per_s_cpu"] = (
                    len(ready) / wall, len(ready) / cpu)
            one = direct[:naive_rows]
            wall, _ = _timed(lambda: [archive.write_window_rows([row._replace(ts=row.ts + 1e8)]) for row in one])
            report["naive_rows"], report["naive_rows_per_s"] = naive_rows, naive_rows / wall
            written = archive.sql("SELECT count() FROM specwatch.window_stats")[1][0][0]
            expected = 3 * rows + 3 * len(ready) + naive_rows
            if written != expected:
                raise RuntimeError(f"the bench wrote {written} window rows, not {expected}")
        finally:
            engine.close()
            client.close()
            archive.close()
    report["insert_rows"] = len(ready)
    report["insert_table_bytes"] = ready.nbytes
    report["sink_over_row_path"] = report["sink_rows_per_s"] / report["row_path_rows_per_s"]
    report["sink_over_direct"] = report["sink_rows_per_s"] / report["direct_rows_per_s"]
    report["speedup_vs_naive"] = report["sink_rows_per_s"] / report["naive_rows_per_s"]
    report["load_average_after"] = os.getloadavg()
    return report
