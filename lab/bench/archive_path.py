"""The archive section of `specwatch bench`: window-stats rows from stage 2 into embedded chDB, by
every path from the same stage-2 output to the same table (docs/BENCHMARKS.md, "Archive")."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["run_archive_bench"]

# The sink's batch before its rows became columns: the row path writes with it.
_ROW_PATH_BATCH = 5000


class _PerSketchArchive:
    """The archive as the sink wrote window rows before the percentiles were read all at once:
    `Archive.write_windows` reading them sketch by sketch; everything else the archive's own."""

    def __init__(self, archive: Any) -> None:
        self._archive = archive

    def __getattr__(self, name: str) -> Any:
        return getattr(self._archive, name)

    def write_windows(self, windows: Any) -> int:
        return self._archive.write_windows(windows, per_sketch=True)


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """Wall and CPU seconds of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, max(time.process_time() - cpu, 1e-9)


def run_archive_bench(template: list, rows: int, naive_rows: int, pairs: int = 3) -> dict:
    """Each path over ``rows`` window rows made from ``template`` (one run's `SliceWindows`); the
    sink against itself reading percentiles sketch by sketch in ``pairs`` alternated pairs."""
    import chdb
    import clickhouse_connect
    import pyarrow as pa

    from specwatch.archive.rows import window_columns_table, window_rows_table, window_stats_table
    from specwatch.archive.sink import ArchiveSink
    from specwatch.archive.store import Archive
    from specwatch.schemas.latency_sketch import quantiles_of
    from specwatch.schemas.slice_stats import window_columns
    from specwatch.schemas.outputs import SliceOutput, SliceWindows

    template = [window for window in template if len(window)]
    span = template[-1].slice_end - template[0].slice_end + 1.0

    def copies(shift: float) -> list[SliceWindows]:
        # distinct slices: each pass over the template moves on in time; the statistics are shared
        out, count, turn = [], 0, 0
        while count < rows:
            for window in template:
                take = min(len(window), rows - count)
                out.append(SliceWindows(window.slice_end + shift + span * turn, window.keys[:take],
                                        window.speculating[:take], window.stats[:take]))
                count += take
                if count == rows:
                    break
            turn += 1
        return out

    def outputs(windows: list) -> list[SliceOutput]:
        return [SliceOutput(slice_index=i, slice_end=float(i), windows=part) for i, part in enumerate(windows)]

    # The first calls import what pyarrow loads lazily and fold the values the sketches still
    # buffer (the detectors have usually done so by then): neither is any path's cost per row.
    window_columns_table(window_columns(template))
    window_rows_table([row for window in template for row in window.rows()])
    sink_windows, by_tuples, by_dicts = copies(0.0), copies(1e7), copies(2e7)
    direct_windows, direct = copies(3e7), copies(4e7)
    # each run of the pairs on slices of its own, later than every other path's
    paired = [(outputs(copies(6e7 + 2e7 * i)), outputs(copies(7e7 + 2e7 * i))) for i in range(pairs)]
    stage2_cpu = _timed(lambda: [window.rows() for window in by_tuples])[1]  # what stage 2 paid per key before
    sink_outputs, tuple_outputs = outputs(sink_windows), outputs([window.rows() for window in by_tuples])
    dict_outputs = outputs([window.rows() for window in by_dicts])
    direct = [row for window in direct for row in window.rows()]
    ready = window_rows_table([row for window in copies(5e7) for row in window.rows()], 0)
    names = ", ".join(ready.schema.names)
    report: dict[str, Any] = {"rows": rows, "slices": len(sink_windows),
                              "rows_per_slice": rows / len(sink_windows), "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.realpath(f"{tmp}/archive")
        archive = Archive.open(f"chdb://{path}")
        # Handles of their own on the same engine, for the paths the archive no longer takes.
        client = clickhouse_connect.get_client(interface="chdb", path=path)
        engine = chdb.connect(path)
        try:
            def through_sink(slice_outputs: list[SliceOutput], into: Any = archive) -> None:
                sink = ArchiveSink(into, spool=Path(tmp) / "spool")  # its own batch, as every command runs it
                for output in slice_outputs:
                    sink(output)
                sink.close()
                if sink.stats()["spooled"] or sink.stats()["dropped_entries"]:
                    raise RuntimeError(f"the archive refused rows during the bench: {sink.stats()}")

            legacy = Archive(client)  # a client passed in: dict rows, insert_arrow's file round trip

            def through_rows() -> None:
                pending: list[dict] = []
                for output in dict_outputs:
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

            measured = {"sink": lambda: through_sink(sink_outputs),
                        "sink_rows": lambda: through_sink(tuple_outputs), "row_path": through_rows,
                        "direct_windows": lambda: archive.write_windows(direct_windows),
                        "direct": lambda: archive.write_window_rows(direct)}
            for name, fn in measured.items():
                wall, cpu = _timed(fn)
                report[f"{name}_rows_per_s"], report[f"{name}_rows_per_s_cpu"] = rows / wall, rows / cpu
                report[f"{name}_cpu_s"] = cpu
            # The sink with percentiles read at once ("bulk") and sketch by sketch, in pairs whose
            # order alternates, so a change in the machine's load falls on both alike.
            per_sketch = _PerSketchArchive(archive)
            report["sink_pairs"] = []
            for i, (bulk_outputs, each_outputs) in enumerate(paired):
                runs = {"bulk": lambda: through_sink(bulk_outputs),
                        "per_sketch": lambda: through_sink(each_outputs, per_sketch)}
                pair = {}
                for name in (("bulk", "per_sketch") if i % 2 == 0 else ("per_sketch", "bulk")):
                    wall, cpu = _timed(runs[name])
                    pair[f"{name}_rows_per_s"], pair[f"{name}_rows_per_s_cpu"] = rows / wall, rows / cpu
                report["sink_pairs"].append(pair)
            dicts = [row.as_dict() for row in direct]
            # Where the build from the statistics goes: the latency percentiles of every key (9
            # t-digest quantiles of its 3 sketches) and the Arrow table from ready columns, alone.
            sketches = [getattr(stats, name) for window in direct_windows for stats in window.stats
                        for name in ("ttft", "tpot", "e2e")]
            ready_columns = window_columns(direct_windows)
            for name, fn in (("stats", lambda: window_columns_table(window_columns(direct_windows), 0)),
                             ("columns", lambda: window_rows_table(direct, 0)),
                             ("dicts", lambda: window_stats_table(dicts, 0)),
                             ("percentiles", lambda: quantiles_of(sketches, (0.5, 0.95, 0.99))),
                             ("table", lambda: window_columns_table(ready_columns, 0))):
                wall, cpu = _timed(fn)
                report[f"build_{name}_rows_per_s"] = rows / cpu
            report["sketches_per_row"] = sum(sketch is not None for sketch in sketches) / rows
            shift = 0.0
            for name, insert in (("memory", by_memory), ("stream", by_stream), ("file", by_file)):
                shift += 1e7  # each transport writes slices of its own
                data = ready.set_column(0, "ts", pa.compute.add(ready.column("ts"), 1e8 + shift))
                wall, cpu = _timed(lambda: insert(data))
                report[f"insert_{name}_rows_per_s"], report[f"insert_{name}_rows_per_s_cpu"] = (
                    len(ready) / wall, len(ready) / cpu)
            one = direct[:naive_rows]
            wall, _ = _timed(lambda: [archive.write_window_rows([row._replace(ts=row.ts + 1e9)]) for row in one])
            report["naive_rows"], report["naive_rows_per_s"] = naive_rows, naive_rows / wall
            written = archive.sql("SELECT count() FROM specwatch.window_stats")[1][0][0]
            expected = 5 * rows + 3 * len(ready) + naive_rows + 2 * pairs * rows
            if written != expected:
                raise RuntimeError(f"the bench wrote {written} window rows, not {expected}")
        finally:
            engine.close()
            client.close()
            archive.close()
    report["insert_rows"] = len(ready)
    report["insert_table_bytes"] = ready.nbytes
    report["stage2_rows_per_s_cpu"] = rows / stage2_cpu
    report["sink_rows_with_stage2_rows_per_s_cpu"] = rows / (report["sink_rows_cpu_s"] + stage2_cpu)
    report["sink_over_sink_rows_cpu"] = report["sink_rows_per_s_cpu"] / report["sink_rows_rows_per_s_cpu"]
    report["sink_over_sink_rows_with_stage2_cpu"] = (report["sink_rows_per_s_cpu"]
                                                     / report["sink_rows_with_stage2_rows_per_s_cpu"])
    report["sink_over_row_path"] = report["sink_rows_per_s"] / report["row_path_rows_per_s"]
    report["sink_over_direct"] = report["sink_rows_per_s"] / report["direct_rows_per_s"]
    report["speedup_vs_naive"] = report["sink_rows_per_s"] / report["naive_rows_per_s"]
    if pairs:
        for key in ("bulk_rows_per_s", "bulk_rows_per_s_cpu", "per_sketch_rows_per_s", "per_sketch_rows_per_s_cpu"):
            report[f"sink_{key}"] = statistics.median(pair[key] for pair in report["sink_pairs"])
        for suffix in ("", "_cpu"):
            report[f"sink_bulk_over_per_sketch{suffix}"] = statistics.median(
                pair[f"bulk_rows_per_s{suffix}"] / pair[f"per_sketch_rows_per_s{suffix}"]
                for pair in report["sink_pairs"])
    report["load_average_after"] = os.getloadavg()
    return report
