//! The step walks of specwatch's block decoders (`schemas/otlp_block.py`, `schemas/lines_block.py`),
//! compiled: OTLP here, JSON Lines in `lines`.
//!
//! `StepWalk.records` reads an ExportLogsServiceRequest that upb has already accepted and
//! gives, for every LogRecord, its span and -- when the record is a valid step in the
//! layout the writer puts on the wire -- the same row `_step_plain` gives. Anything else
//! (another layout, another kind, a value failing the contract's checks, a name outside
//! printable ASCII) is left to the Python reference path: a row here is only ever a row
//! the reference would give, so declining is always safe and being unsure means declining.
//! The layout's constant bytes come from the Python writer at construction, so that the
//! two readers cannot disagree on what the writer writes.

use std::collections::HashMap;

mod admission;
mod lines;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

const ATTRIBUTE: u8 = 0x32;
const STAMP: u8 = 0x09;
const OBSERVED: u8 = 0x59;
const BODY: u8 = 0x2A;
const FLAGS: u8 = 0x45;
const TRACE_ID: u8 = 0x4A;
const SPAN_ID: u8 = 0x52;
const INT64_SIGN: u64 = 1 << 63;

/// The varint at `p` and the position after it; None past the buffer or past 64 bits.
#[inline]
fn varint(buf: &[u8], mut p: usize) -> Option<(u64, usize)> {
    let mut value: u64 = 0;
    let mut shift = 0u32;
    loop {
        let byte = *buf.get(p)?;
        p += 1;
        if shift > 63 || (shift == 63 && byte > 1) {
            return None; // more than Python's int would hold in 64 bits: the reference decides
        }
        value |= u64::from(byte & 0x7F) << shift;
        if byte < 0x80 {
            return Some((value, p));
        }
        shift += 7;
    }
}

#[inline]
fn size_at(buf: &[u8], p: usize) -> Option<(usize, usize)> {
    let (size, q) = varint(buf, p)?;
    Some((usize::try_from(size).ok()?, q))
}

/// The position after a field's payload, `p` just after its tag (`otlp_block._skip`).
fn skip(buf: &[u8], p: usize, wire_type: u64) -> Option<usize> {
    match wire_type {
        0 => {
            let mut p = p;
            while *buf.get(p)? & 0x80 != 0 {
                p += 1;
            }
            Some(p + 1)
        }
        1 => Some(p + 8),
        2 => {
            let (size, q) = size_at(buf, p)?;
            q.checked_add(size)
        }
        5 => Some(p + 4),
        _ => None,
    }
}

/// (start, end) of each length-delimited field `tag` in buf[p..end] (`otlp_block._fields`).
fn fields(buf: &[u8], mut p: usize, end: usize, tag: u64, out: &mut Vec<(usize, usize)>) -> Option<()> {
    while p < end {
        let (found, q) = varint(buf, p)?;
        if found != tag {
            p = skip(buf, q, found & 7)?;
            continue;
        }
        let (size, q) = size_at(buf, q)?;
        let field_end = q.checked_add(size)?;
        out.push((q, field_end));
        p = field_end;
    }
    if p == end {
        Some(())
    } else {
        None
    }
}

/// Every LogRecord's (start, end), in upb's order (`otlp_block._log_record_spans`).
fn log_record_spans(buf: &[u8]) -> Option<Vec<(usize, usize)>> {
    let (mut resources, mut scopes, mut records) = (Vec::new(), Vec::new(), Vec::new());
    fields(buf, 0, buf.len(), 0x0A, &mut resources)?;
    for &(start, end) in &resources {
        scopes.clear();
        fields(buf, start, end, 0x12, &mut scopes)?;
        for &(s, e) in &scopes {
            fields(buf, s, e, 0x12, &mut records)?;
        }
    }
    Some(records)
}

/// The end of the LogRecord attribute (field 6) at `p`, if it ends by `end`.
#[inline]
fn attribute_end(buf: &[u8], p: usize, end: usize) -> Option<usize> {
    if *buf.get(p)? != ATTRIBUTE {
        return None;
    }
    let (size, q) = size_at(buf, p + 1)?;
    let q = q.checked_add(size)?;
    if q <= end {
        Some(q)
    } else {
        None
    }
}

/// Key and value span of one serialized attribute (tag, size, KeyValue): a key field and
/// a value field, once each, in either order (`otlp_block._key_value`, the rest declined).
fn key_value(attribute: &[u8]) -> Option<(&[u8], usize, usize)> {
    let (_, mut p) = varint(attribute, 1)?;
    let end = attribute.len();
    let (mut key, mut value) = (None, None);
    while p < end {
        let field = attribute[p];
        let (size, q) = size_at(attribute, p + 1)?;
        let field_end = q.checked_add(size)?;
        if field_end > end {
            return None;
        }
        match field {
            0x0A if key.is_none() => key = Some(&attribute[q..field_end]),
            0x12 if value.is_none() => value = Some((q, field_end)),
            _ => return None,
        }
        p = field_end;
    }
    let (start, stop) = value?;
    Some((key?, start, stop))
}

/// The value span of an attribute holding `key`.
#[inline]
fn value_of<'a>(attribute: &'a [u8], key: &[u8]) -> Option<(usize, usize)> {
    let (found, start, end) = key_value(attribute)?;
    if found == key {
        Some((start, end))
    } else {
        None
    }
}

/// The string_value filling the AnyValue buf[start..end] exactly.
#[inline]
fn string_value(buf: &[u8], start: usize, end: usize) -> Option<&[u8]> {
    if start >= end || buf[start] != 0x0A {
        return None;
    }
    let (size, p) = size_at(buf, start + 1)?;
    if p.checked_add(size)? != end {
        return None;
    }
    Some(&buf[p..end])
}

/// The ArrayValue body inside the AnyValue buf[start..end] (`otlp_block._array_body`).
#[inline]
fn array_body(buf: &[u8], start: usize, end: usize) -> Option<(usize, usize)> {
    if start >= end || buf[start] != 0x2A {
        return None;
    }
    let (size, p) = size_at(buf, start + 1)?;
    if p.checked_add(size)? != end {
        return None;
    }
    Some((p, end))
}

/// An ArrayValue body of int elements in the plain form (0a 02 18 vv): the values vv
/// (`otlp_wire.small_ints`).
fn small_ints(body: &[u8]) -> Option<Vec<u8>> {
    if body.len() % 4 != 0 {
        return None;
    }
    let mut values = Vec::with_capacity(body.len() / 4);
    for element in body.chunks_exact(4) {
        if element[0] != 0x0A || element[1] != 0x02 || element[2] != 0x18 {
            return None;
        }
        values.push(element[3]);
    }
    Some(values)
}

fn f64_at(buf: &[u8], p: usize) -> Option<f64> {
    Some(f64::from_le_bytes(buf.get(p..p + 8)?.try_into().ok()?))
}

fn starts_with_at(buf: &[u8], p: usize, head: &[u8]) -> bool {
    buf.get(p..p + head.len()) == Some(head)
}

/// The contract's checks on a name that both walks make themselves.
struct NameRules {
    max_chars: usize,
    every: Vec<u8>,
    separator: u8,
}

impl NameRules {
    /// Whether `name` is a Name the reference takes without looking closer: 1 to the
    /// maximum of printable ASCII characters (others: the reference decides).
    #[inline]
    fn plain(&self, name: &[u8]) -> bool {
        !name.is_empty() && name.len() <= self.max_chars && name.iter().all(|&c| (0x20..0x7F).contains(&c))
    }

    /// Whether a bucket or cohort name can stand in a scope key (`contract.scope_name_ok`).
    #[inline]
    fn scope_ok(&self, name: &[u8]) -> bool {
        name != self.every.as_slice() && !name.contains(&self.separator)
    }
}

/// The walk's constants (the writer's layout and the contract's bounds) and its reader.
#[pyclass(frozen, module = "specwatch_native")]
struct StepWalk {
    v_ts_head: Vec<u8>,
    seq_heads: HashMap<u8, (Vec<u8>, usize)>,
    times_heads: [Vec<u8>; 3],
    worker_key: Vec<u8>,
    bundle_key: Vec<u8>,
    column_keys: [Vec<u8>; 5],
    event_field: Vec<u8>,
    names: NameRules,
    max_requests: usize,
    max_draft_tokens: u8,
}

/// What repeats across the step records of one request, per slot, keyed by the attribute's
/// bytes (the key is in those bytes, and each slot checks its own).
#[derive(Default)]
struct Memo<'a, 'py> {
    workers: HashMap<&'a [u8], Option<Bound<'py, PyString>>>,
    bundles: HashMap<&'a [u8], Option<Bound<'py, PyString>>>,
    columns: [HashMap<&'a [u8], Option<Bound<'py, PyTuple>>>; 3],
}

impl StepWalk {
    fn name<'a, 'py>(
        &self,
        py: Python<'py>,
        attribute: &'a [u8],
        key: &[u8],
        memo: &mut HashMap<&'a [u8], Option<Bound<'py, PyString>>>,
    ) -> Option<Bound<'py, PyString>> {
        if let Some(found) = memo.get(attribute) {
            return found.clone();
        }
        let found = value_of(attribute, key)
            .and_then(|(start, end)| string_value(attribute, start, end))
            .filter(|name| self.names.plain(name))
            // printable ASCII is UTF-8
            .map(|name| PyString::new(py, std::str::from_utf8(name).unwrap_or_default()));
        memo.insert(attribute, found.clone());
        found
    }

    /// An id, bucket or cohort column; `scoped`: each value must also stand in a scope key.
    fn strings<'a, 'py>(
        &self,
        py: Python<'py>,
        attribute: &'a [u8],
        key: &[u8],
        scoped: bool,
        memo: &mut HashMap<&'a [u8], Option<Bound<'py, PyTuple>>>,
    ) -> Option<Bound<'py, PyTuple>> {
        if let Some(found) = memo.get(attribute) {
            return found.clone();
        }
        let found = self.read_strings(py, attribute, key, scoped);
        memo.insert(attribute, found.clone());
        found
    }

    fn read_strings<'py>(&self, py: Python<'py>, attribute: &[u8], key: &[u8], scoped: bool) -> Option<Bound<'py, PyTuple>> {
        let (start, end) = value_of(attribute, key)?;
        let (mut p, end) = array_body(attribute, start, end)?;
        let mut values = Vec::new();
        while p < end {
            if attribute[p] != 0x0A {
                return None;
            }
            let (size, q) = size_at(attribute, p + 1)?;
            let element_end = q.checked_add(size)?;
            if element_end > end {
                return None;
            }
            let value = string_value(attribute, q, element_end)?;
            if !self.names.plain(value) || (scoped && !self.names.scope_ok(value)) {
                return None;
            }
            values.push(PyString::new(py, std::str::from_utf8(value).ok()?));
            p = element_end;
        }
        PyTuple::new(py, values).ok()
    }

    /// A drafted or accepted column's counts.
    fn counts(&self, attribute: &[u8], key: &[u8]) -> Option<Vec<u8>> {
        let (start, end) = value_of(attribute, key)?;
        let (body_start, body_end) = array_body(attribute, start, end)?;
        small_ints(&attribute[body_start..body_end])
    }

    /// The step in buf[start..end] as `_step_plain` reads it and `_step` keeps it; None to
    /// leave the record to the reference.
    fn step<'a, 'py>(
        &self,
        py: Python<'py>,
        buf: &'a [u8],
        start: usize,
        end: usize,
        memo: &mut Memo<'a, 'py>,
    ) -> Option<Bound<'py, PyTuple>> {
        let buf = &buf[..end]; // nothing read here lies past the record
        let mut p = if *buf.get(start)? == STAMP { start + 9 } else { start };
        if buf.get(p) == Some(&BODY) && buf.get(p + 1) == Some(&0) {
            p += 2;
        }
        if !starts_with_at(buf, p, &self.v_ts_head) {
            return None;
        }
        let ts = f64_at(buf, p + self.v_ts_head.len())?;
        p += self.v_ts_head.len() + 8;
        let q = attribute_end(buf, p, end)?;
        let worker = self.name(py, &buf[p..q], &self.worker_key, &mut memo.workers)?;
        let (head, width) = self.seq_heads.get(buf.get(q + 1)?)?;
        if !starts_with_at(buf, q, head) {
            return None;
        }
        p = q + head.len();
        let (seq, after) = varint(buf, p)?;
        p += width;
        if after != p || seq >= INT64_SIGN {
            return None;
        }
        let q = attribute_end(buf, p, end)?;
        let bundle_id = self.name(py, &buf[p..q], &self.bundle_key, &mut memo.bundles)?;
        let mut p = q;
        let mut times = [0.0f64; 3];
        for (head, time) in self.times_heads.iter().zip(times.iter_mut()) {
            if !starts_with_at(buf, p, head) {
                return None;
            }
            *time = f64_at(buf, p + head.len())?;
            p += head.len() + 8;
        }
        let [draft_ms, verify_ms, kv_usage] = times;
        let mut columns: [Option<Bound<'py, PyTuple>>; 3] = [None, None, None];
        for (i, column) in columns.iter_mut().enumerate() {
            let q = attribute_end(buf, p, end)?;
            *column = Some(self.strings(py, &buf[p..q], &self.column_keys[i], i > 0, &mut memo.columns[i])?);
            p = q;
        }
        let q = attribute_end(buf, p, end)?;
        let drafted = self.counts(&buf[p..q], &self.column_keys[3])?;
        p = attribute_end(buf, q, end)?;
        let accepted = self.counts(&buf[q..p], &self.column_keys[4])?;
        // flags, trace id, span id and observed time, which a step never reads
        if buf.get(p) == Some(&FLAGS) {
            p += 5;
        }
        for tag in [TRACE_ID, SPAN_ID] {
            if buf.get(p) == Some(&tag) {
                match buf.get(p + 1) {
                    Some(&size) if size < 0x80 => p += 2 + usize::from(size),
                    _ => {}
                }
            }
        }
        if buf.get(p) == Some(&OBSERVED) {
            p += 9;
        }
        if p + self.event_field.len() != end || !starts_with_at(buf, p, &self.event_field) {
            return None;
        }
        let finite = |x: f64| (0.0..f64::INFINITY).contains(&x);
        if !(finite(ts) && finite(draft_ms) && finite(verify_ms) && (0.0..=1.0).contains(&kv_usage)) {
            return None;
        }
        let [ids, buckets, cohorts] = columns.map(Option::unwrap);
        let n = ids.len();
        if n > self.max_requests || buckets.len() != n || cohorts.len() != n || drafted.len() != n || accepted.len() != n {
            return None;
        }
        if drafted.iter().any(|&d| d > self.max_draft_tokens) || accepted.iter().zip(&drafted).any(|(a, d)| a > d) {
            return None;
        }
        let header = (ts, worker, seq, bundle_id, draft_ms, verify_ms, kv_usage).into_pyobject(py).ok()?;
        (header, ids, buckets, cohorts, PyBytes::new(py, &drafted), PyBytes::new(py, &accepted))
            .into_pyobject(py)
            .ok()
    }
}

#[pymethods]
impl StepWalk {
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        v_ts_head: Vec<u8>,
        seq_heads: HashMap<u8, (Vec<u8>, usize)>,
        times_heads: [Vec<u8>; 3],
        worker_key: Vec<u8>,
        bundle_key: Vec<u8>,
        column_keys: [Vec<u8>; 5],
        event_field: Vec<u8>,
        max_name_chars: usize,
        max_requests: usize,
        max_draft_tokens: u8,
        every: Vec<u8>,
        separator: u8,
    ) -> Self {
        StepWalk {
            v_ts_head,
            seq_heads,
            times_heads,
            worker_key,
            bundle_key,
            column_keys,
            event_field,
            names: NameRules { max_chars: max_name_chars, every, separator },
            max_requests,
            max_draft_tokens,
        }
    }

    /// Each LogRecord of the request as (start, end, row), row None where the reference
    /// decides; None for the whole request if its records cannot be told apart here.
    fn records<'py>(&self, py: Python<'py>, buf: &[u8]) -> PyResult<Option<Bound<'py, PyList>>> {
        let Some(spans) = log_record_spans(buf) else {
            return Ok(None);
        };
        let mut memo = Memo::default();
        let out = PyList::empty(py);
        for (start, end) in spans {
            if end > buf.len() {
                return Ok(None);
            }
            let row = self.step(py, buf, start, end, &mut memo);
            out.append((start, end, row))?;
        }
        Ok(Some(out))
    }
}

#[pymodule]
fn specwatch_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<StepWalk>()?;
    m.add_class::<lines::LineWalk>()?;
    m.add_class::<admission::ClockCore>()?;
    Ok(())
}
