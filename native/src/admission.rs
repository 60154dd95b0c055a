//! Stage 1's per-step admission (`streams/intake.py`, `Stage1._admit_block`), compiled: the
//! source's event clock (`ClockCore`, the state of `EventClock` with the same arithmetic, step
//! for step) and, for a run of a block's steps, the duplicate check against the filter's own
//! sets and the running-request tracker's common case (the same batch as the worker's step
//! before). Whatever is not the common case -- a record the clock refuses, a duplicate, a step
//! listing other requests -- is reported back or handed to the Python reference, so the two
//! paths decide every record alike (`tests/test_native_admission.py`).

use std::cmp::Ordering;
use std::collections::HashMap;

use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyFloat, PyList, PySet, PyString, PyTuple};

// the constants of streams/intake.py
const REFRESH_EVERY: u64 = 4;
const ACTIVE_SECONDS: f64 = 60.0;
const FORGET_SECONDS: f64 = 3600.0;
const FORGET_EVERY: u64 = 8192;
const IN_ORDER_SECONDS: f64 = 60.0;
const LAG_TRUSTED_AFTER: u64 = 16;

/// What the reject codes of `admit_steps` mean to the caller.
const TS_IN_FUTURE: u8 = 0;
const CLOCK_AHEAD: u8 = 1;
const CLOCK_BEHIND: u8 = 2;
const DUPLICATE: u8 = 3;

/// Python's `sorted` of floats (a stable sort; NaN is never among them).
fn sorted(values: &[f64]) -> Vec<f64> {
    let mut out = values.to_vec();
    out.sort_by(|a, b| a.partial_cmp(b).unwrap_or(Ordering::Equal));
    out
}

fn lower_median(ordered: &[f64]) -> f64 {
    ordered[(ordered.len() - 1) >> 1]
}

/// Python's float `a // b` (Objects/floatobject.c), so slice indices agree to the last bit.
pub fn floor_div(vx: f64, wx: f64) -> f64 {
    let mut modulo = vx % wx;
    let mut div = (vx - modulo) / wx;
    if modulo != 0.0 {
        if (wx < 0.0) != (modulo < 0.0) {
            modulo += wx;
            div -= 1.0;
        }
    }
    let _ = modulo;
    if div != 0.0 {
        let mut floordiv = div.floor();
        if div - floordiv > 0.5 {
            floordiv += 1.0;
        }
        floordiv
    } else {
        (0.0f64).copysign(vx / wx)
    }
}

struct Writer {
    skews: Vec<f64>,
    count: u64,
    offset: f64,
    seen: f64,
    newest: f64,
    lag: f64,
}

impl Writer {
    fn new(offset: f64) -> Self {
        Writer {
            skews: Vec::new(),
            count: 0,
            offset,
            seen: f64::NEG_INFINITY,
            newest: f64::NEG_INFINITY,
            lag: f64::NEG_INFINITY,
        }
    }

    /// `EventClock._passed_at`: the time before which it sends nothing more, as far as it has shown.
    fn passed_at(&self, now: f64) -> f64 {
        if self.count < LAG_TRUSTED_AFTER {
            return self.newest;
        }
        let behind = if self.lag > 0.0 { now - self.lag } else { now };
        if behind > self.newest {
            behind
        } else {
            self.newest
        }
    }
}

enum Admitted {
    Folded(f64),
    /// (ahead, off, where its writer's clock puts it)
    Refused(bool, f64, f64),
}

/// The state and arithmetic of `EventClock`; `NativeEventClock` in `streams/intake.py` wraps it.
#[pyclass(module = "specwatch_native")]
pub struct ClockCore {
    max_skew: f64,
    tolerance: f64,
    #[pyo3(get)]
    now: f64,
    #[pyo3(get)]
    primed: bool,
    start: f64,
    median: f64,
    recent: Vec<f64>,
    size: usize,
    seen: u64,
    writers: HashMap<String, Writer>,
    writer_size: usize,
    close_on_writers: bool,
    calm_from: f64,
    promised: f64,
    /// the writer that held slices back last (only a shortcut, as in `EventClock`)
    blocker: Option<String>,
}

impl ClockCore {
    fn admit_one(&mut self, ts: f64, writer: &str) -> Admitted {
        let seen = self.seen;
        let mut reference = if seen != 0 {
            self.median
        } else {
            if self.start.is_nan() {
                self.primed = true;
                self.start = ts;
                if self.close_on_writers {
                    self.out_of_order(ts);
                }
            }
            self.start
        };
        let (size, tolerance) = (self.writer_size, self.tolerance);
        if !self.writers.contains_key(writer) {
            self.writers.insert(writer.to_owned(), Writer::new(0.0));
        }
        let w = self.writers.get_mut(writer).expect("inserted above");
        let mut skew = ts - reference;
        w.seen = reference;
        let count = w.count;
        if (count as usize) < size {
            w.skews.push(skew);
        } else {
            w.skews[(count % size as u64) as usize] = skew;
        }
        let count = count + 1;
        w.count = count;
        if count >= ((size as u64 + 1) >> 1) && (count <= size as u64 || count % REFRESH_EVERY == 0) {
            let measured = lower_median(&sorted(&w.skews));
            if (measured - w.offset).abs() > tolerance {
                w.offset = if measured.abs() > tolerance { measured } else { 0.0 };
                self.follow_writers();
                if seen != 0 {
                    reference = self.median;
                }
                skew = ts - reference;
            }
        }
        let offset = self.writers[writer].offset;
        let off = skew - offset;
        if off > self.max_skew || -off > self.max_skew {
            if self.close_on_writers {
                self.out_of_order(reference);
            }
            return Admitted::Refused(off > self.max_skew, off, reference + offset);
        }
        if -tolerance <= off && off <= tolerance {
            let corrected = if offset != 0.0 { ts - offset } else { ts };
            if self.close_on_writers {
                self.passed(writer, corrected, reference);
            }
            self.add_recent(corrected);
            return Admitted::Folded(corrected);
        }
        if self.close_on_writers {
            self.out_of_order(reference);
        }
        Admitted::Folded(reference)
    }

    /// `EventClock._passed`.
    fn passed(&mut self, writer: &str, ts: f64, reference: f64) {
        let (now, promised) = (self.now, self.promised);
        let w = self.writers.get_mut(writer).expect("admitted above");
        let disorder = ts < w.newest || ts < promised;
        if ts > w.newest {
            w.newest = ts;
        }
        let lag = now - ts;
        if lag > w.lag {
            w.lag = lag;
        }
        if disorder {
            self.out_of_order(reference);
        }
    }

    fn out_of_order(&mut self, reference: f64) {
        let calm_from = reference + IN_ORDER_SECONDS;
        if calm_from > self.calm_from {
            self.calm_from = calm_from;
        }
    }

    /// `EventClock.close_limit`.
    fn limit(&mut self, slice_s: f64, lateness: f64, watermark: i64) -> i64 {
        let now = self.now;
        if now == f64::NEG_INFINITY {
            return watermark;
        }
        let limit = floor_div(now - lateness, slice_s) as i64 - 1;
        if !self.close_on_writers || now < self.calm_from {
            return limit;
        }
        let base = if limit > watermark { limit } else { watermark };
        if floor_div(now, slice_s) as i64 - 1 <= base {
            return limit;
        }
        let horizon = now - ACTIVE_SECONDS;
        if let Some(w) = self.blocker.as_ref().and_then(|name| self.writers.get(name)) {
            if w.seen >= horizon {
                let at = w.passed_at(now);
                if at == f64::NEG_INFINITY || floor_div(at, slice_s) as i64 - 1 <= base {
                    return limit;
                }
            }
        }
        let mut settled = self.recent.iter().copied().fold(f64::INFINITY, f64::min);
        let mut blocker: Option<&String> = None;
        for (name, w) in self.writers.iter() {
            if w.seen >= horizon {
                let at = w.passed_at(now);
                if at < settled {
                    settled = at;
                    blocker = Some(name);
                }
            }
        }
        self.blocker = blocker.cloned();
        if settled == f64::NEG_INFINITY {
            return limit;
        }
        let early = floor_div(settled, slice_s) as i64 - 1;
        if early <= base {
            return limit;
        }
        if settled > self.promised {
            self.promised = settled;
        }
        early
    }

    fn add_recent(&mut self, ts: f64) {
        let seen = self.seen;
        if (seen as usize) < self.size {
            self.recent.push(ts);
        } else {
            let at = (seen % self.size as u64) as usize;
            self.recent[at] = ts;
        }
        let seen = seen + 1;
        self.seen = seen;
        if seen <= self.size as u64 || seen % REFRESH_EVERY == 0 {
            self.refresh();
            if seen % FORGET_EVERY == 0 {
                let horizon = self.median - FORGET_SECONDS;
                self.writers.retain(|_, w| w.seen >= horizon);
                self.blocker = None;
            }
        }
    }

    fn refresh(&mut self) {
        let ordered = sorted(&self.recent);
        self.median = lower_median(&ordered);
        if ordered.len() >= 3 && self.median > self.now {
            self.now = self.median;
        }
    }

    fn follow_writers(&mut self) {
        let reference = if self.seen != 0 { self.median } else { self.start };
        let active: Vec<f64> =
            self.writers.values().filter(|w| w.seen >= reference - ACTIVE_SECONDS).map(|w| w.offset).collect();
        let shift = if active.is_empty() { 0.0 } else { lower_median(&sorted(&active)) };
        let tolerance = self.tolerance;
        if shift <= tolerance && !(shift < -tolerance && self.now == f64::NEG_INFINITY) {
            return;
        }
        for w in self.writers.values_mut() {
            if (w.offset - shift).abs() <= tolerance {
                for skew in w.skews.iter_mut() {
                    *skew -= shift;
                }
                w.offset = 0.0;
            } else {
                w.skews.clear();
                w.count = 0;
            }
        }
        self.start += shift;
        if self.seen != 0 {
            for ts in self.recent.iter_mut() {
                *ts += shift;
            }
            self.refresh();
        }
    }
}

/// One call of `admit_steps`: what it admitted and refused, and where it stopped.
#[derive(IntoPyObject)]
pub struct Run<'py> {
    next_row: usize,
    close: bool,
    rows: Bound<'py, PyList>,
    slices: Bound<'py, PyList>,
    late: Bound<'py, PyList>,
    opened: Vec<(i64, u64)>,
    rejected: Bound<'py, PyList>,
    moved: Bound<'py, PyList>,
}

type WriterState = (String, f64, u64, Vec<f64>, f64, f64, f64);
type ClockState = (f64, bool, f64, f64, Vec<f64>, u64, Vec<WriterState>, f64, f64);

#[pymethods]
impl ClockCore {
    #[new]
    #[pyo3(signature = (max_skew_seconds, recent, writer_recent, close_on_writers=false))]
    fn new(max_skew_seconds: f64, recent: usize, writer_recent: usize, close_on_writers: bool) -> PyResult<Self> {
        if recent < 1 || recent % 2 == 0 || writer_recent < 1 || writer_recent % 2 == 0 {
            return Err(PyValueError::new_err("recent and writer_recent must be positive odd counts"));
        }
        Ok(ClockCore {
            max_skew: max_skew_seconds,
            tolerance: max_skew_seconds / 5.0,
            now: f64::NEG_INFINITY,
            primed: false,
            start: f64::NAN,
            median: f64::NAN,
            recent: Vec::new(),
            size: recent,
            seen: 0,
            writers: HashMap::new(),
            writer_size: writer_recent,
            close_on_writers,
            calm_from: f64::NEG_INFINITY,
            promised: f64::NEG_INFINITY,
            blocker: None,
        })
    }

    /// `(now, primed, start, median, recent, seen, writers, calm_from, promised)`, writers as
    /// `(name, offset, count, skews, seen, newest, lag)` sorted by name: what `EventClock.to_state`
    /// holds (the last two of each writer, and the last two, with `close_on_writers` only).
    fn export(&self) -> ClockState {
        let mut writers: Vec<WriterState> = self
            .writers
            .iter()
            .map(|(name, w)| (name.clone(), w.offset, w.count, w.skews.clone(), w.seen, w.newest, w.lag))
            .collect();
        writers.sort_by(|a, b| a.0.cmp(&b.0));
        (self.now, self.primed, self.start, self.median, self.recent.clone(), self.seen, writers, self.calm_from,
         self.promised)
    }

    /// Take the state `export` gives (checked by the caller, as `EventClock.load_state` checks it).
    #[pyo3(name = "import_")]
    fn import(&mut self, state: ClockState) -> PyResult<()> {
        let (now, primed, start, median, recent, seen, writers, calm_from, promised) = state;
        if recent.len() > self.size || writers.iter().any(|w| w.3.len() > self.writer_size) {
            return Err(PyValueError::new_err("more recent records or skews than this clock holds"));
        }
        self.now = now;
        self.primed = primed;
        self.start = start;
        self.median = median;
        self.recent = recent;
        self.seen = seen;
        self.writers = writers
            .into_iter()
            .map(|(name, offset, count, skews, seen, newest, lag)| {
                (name, Writer { skews, count, offset, seen, newest, lag })
            })
            .collect();
        self.calm_from = calm_from;
        self.promised = promised;
        self.blocker = None;
        Ok(())
    }

    /// `EventClock.close_limit`: the newest slice index the source's time lets close.
    fn close_limit(&mut self, slice_s: f64, lateness: f64, watermark: i64) -> i64 {
        self.limit(slice_s, lateness, watermark)
    }

    /// One record's time: a float to fold it at, or `(ahead, off, where its writer's clock puts it)`.
    fn admit<'py>(&mut self, py: Python<'py>, ts: f64, writer: &str) -> PyResult<Bound<'py, PyAny>> {
        Ok(match self.admit_one(ts, writer) {
            Admitted::Folded(at) => PyFloat::new(py, at).into_any(),
            Admitted::Refused(ahead, off, at) => (ahead, off, at).into_pyobject(py)?.into_any(),
        })
    }

    /// Admit a block's steps from row `start` on, as `Stage1._admit_block` does one by one,
    /// until the step at `stop_at` or later (a record of another kind comes first), the end,
    /// or a step after which slices may close. Every admitted step is checked against the
    /// duplicate filter's sets (`by_slice`, changed in place), and told to the running
    /// tracker (`running`, its workers by name): its common case here, the rest through
    /// `saw(row, ts)`.
    ///
    /// Returns `(next_row, close, rows, slices, late, opened, rejected, moved)`: the rows
    /// admitted and the slice each folds into (a late one's the oldest open), `(position, ts)`
    /// of the late ones, `(slice, late count)` of each slice in the order the steps reach
    /// them, refused rows as `(row, code, ts, off, at)` (codes: 0 ts_in_future, 1 clock_ahead,
    /// 2 clock_behind, 3 duplicate), and `(row, ts)` of those whose time the clock corrected.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (start, stop_at, ts, workers, seqs, at, step_ids, now, max_ahead, slice_s, lateness,
                        watermark, by_slice, running, lost_after, saw))]
    fn admit_steps<'py>(
        &mut self,
        py: Python<'py>,
        start: usize,
        stop_at: i64,
        ts: &Bound<'py, PyList>,
        workers: &Bound<'py, PyList>,
        seqs: &Bound<'py, PyList>,
        at: &Bound<'py, PyList>,
        step_ids: &Bound<'py, PyList>,
        now: Option<f64>,
        max_ahead: f64,
        slice_s: f64,
        lateness: f64,
        watermark: i64,
        by_slice: &Bound<'py, PyDict>,
        running: &Bound<'py, PyDict>,
        lost_after: f64,
        saw: &Bound<'py, PyAny>,
    ) -> PyResult<Run<'py>> {
        let mut run = Run {
            next_row: start,
            close: false,
            rows: PyList::empty(py),
            slices: PyList::empty(py),
            late: PyList::empty(py),
            opened: Vec::new(),
            rejected: PyList::empty(py),
            moved: PyList::empty(py),
        };
        let rows = ts.len();
        let (ts_name, ids_name, first_name) = (intern!(py, "ts"), intern!(py, "ids"), intern!(py, "first"));
        let mut row = start;
        while row < rows {
            let position: i64 = at.get_item(row)?.extract()?;
            if position > stop_at {
                break;
            }
            let step_ts: f64 = ts.get_item(row)?.extract()?;
            if let Some(now) = now {
                if !(step_ts - now <= max_ahead) {
                    run.rejected.append((row, TS_IN_FUTURE, step_ts, 0.0, 0.0))?;
                    row += 1;
                    continue;
                }
            }
            let worker_item = workers.get_item(row)?;
            let worker = worker_item.cast::<PyString>()?;
            let folded = match self.admit_one(step_ts, worker.to_str()?) {
                Admitted::Refused(ahead, off, where_) => {
                    let code = if ahead { CLOCK_AHEAD } else { CLOCK_BEHIND };
                    run.rejected.append((row, code, step_ts, off, where_))?;
                    row += 1;
                    continue;
                }
                Admitted::Folded(folded) => folded,
            };
            if folded != step_ts {
                run.moved.append((row, folded))?;
            }
            let index = floor_div(folded, slice_s) as i64;
            let identity = PyTuple::new(py, [worker_item.clone(), seqs.get_item(row)?])?;
            let first = match by_slice.get_item(index)? {
                None => {
                    let seen = PySet::new(py, [&identity])?;
                    by_slice.set_item(index, seen)?;
                    true
                }
                Some(seen) => {
                    let seen = seen.cast::<PySet>()?;
                    if seen.contains(&identity)? {
                        false
                    } else {
                        seen.add(&identity)?;
                        true
                    }
                }
            };
            if !first {
                run.rejected.append((row, DUPLICATE, folded, 0.0, 0.0))?;
                row += 1;
                continue;
            }
            let ids = step_ids.get_item(row)?;
            let mut common = false;
            if let Some(w) = running.get_item(worker)? {
                let last: f64 = w.getattr(ts_name)?.extract()?;
                if !(folded - last >= lost_after && w.getattr(first_name)?.is_truthy()?)
                    && ids.eq(w.getattr(ids_name)?)?
                {
                    w.setattr(ts_name, folded)?;
                    common = true;
                }
            }
            if !common {
                saw.call1((row, folded))?;
            }
            // a step of a closed slice is folded into the oldest open one, and counted late
            let is_late = index <= watermark;
            let index = if is_late { watermark + 1 } else { index };
            if is_late {
                run.late.append((position, folded))?;
            }
            match run.opened.iter_mut().find(|(opened, _)| *opened == index) {
                Some(entry) => entry.1 += u64::from(is_late),
                None => run.opened.push((index, u64::from(is_late))),
            }
            run.rows.append(row)?;
            run.slices.append(index)?;
            row += 1;
            if self.limit(slice_s, lateness, watermark) > watermark {
                run.close = true;
                break;
            }
        }
        run.next_row = row;
        Ok(run)
    }
}
