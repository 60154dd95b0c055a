//! The JSON Lines block decoder's read of steps in the writer's layout (`lines_block.decode_lines_block`).
//!
//! `LineWalk.block` reads each line that is a step exactly as `encode_record` writes it --
//! keys in the writer's order, no whitespace inside, names of printable ASCII without
//! escapes, counts of one or two digits -- and whose values pass the contract's checks, and
//! gives those steps as the columns of a block. Every other line (another kind, another
//! layout, an escape, a value a check refuses) is declined to the Python reference path, so
//! a row here is only ever a row the reference would give.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyList, PyString, PyTuple};

use crate::NameRules;

/// The Fx hash (rustc's, as in the rustc-hash crate): the walk's maps are keyed by short
/// names of one block, where SipHash's defence against chosen keys is a fifth of the walk.
#[derive(Default, Clone, Copy)]
struct FxHasher(u64);

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let word = u64::from_le_bytes(chunk.try_into().unwrap_or_default());
            self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(SEED);
        }
        for &byte in chunks.remainder() {
            self.0 = (self.0.rotate_left(5) ^ u64::from(byte)).wrapping_mul(SEED);
        }
    }

    #[inline]
    fn write_usize(&mut self, value: usize) {
        self.0 = (self.0.rotate_left(5) ^ value as u64).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

/// JSON's insignificant whitespace, which may follow the object (a line read with its newline).
#[inline]
fn blank(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | b'\r')
}

/// A cursor over one line; every read checks what it expects and gives None otherwise.
struct Cursor<'a> {
    buf: &'a [u8],
    p: usize,
}

impl<'a> Cursor<'a> {
    #[inline]
    fn literal(&mut self, text: &[u8]) -> Option<()> {
        if self.buf.get(self.p..self.p + text.len())? == text {
            self.p += text.len();
            Some(())
        } else {
            None
        }
    }

    #[inline]
    fn byte(&mut self) -> Option<u8> {
        let c = *self.buf.get(self.p)?;
        self.p += 1;
        Some(c)
    }

    /// A Name of printable ASCII without an escape, its opening quote already read: the
    /// bytes up to the next quote.
    #[inline]
    fn name(&mut self, rules: &NameRules) -> Option<&'a [u8]> {
        let start = self.p;
        let rest = self.buf.get(start..)?;
        // one pass: up to the closing quote, every byte printable ASCII and no escape
        let len = rest.iter().position(|&c| c == b'"' || c == b'\\' || !(0x20..0x7F).contains(&c))?;
        if rest[len] != b'"' || len == 0 || len > rules.max_chars {
            return None;
        }
        self.p = start + len + 1; // past the closing quote
        Some(&rest[..len])
    }

    /// A JSON number without a sign, as a float (msgspec reads an integer into a float field
    /// as its float); None for a form the reference alone should judge.
    #[inline]
    fn number(&mut self) -> Option<f64> {
        let start = self.p;
        let buf = self.buf;
        let digits = |mut p: usize| {
            let from = p;
            while p < buf.len() && buf[p].is_ascii_digit() {
                p += 1;
            }
            (p, p - from)
        };
        let (mut p, whole) = digits(start);
        if whole == 0 || (whole > 1 && buf[start] == b'0') {
            return None;
        }
        let mut significant = whole;
        if buf.get(p) == Some(&b'.') {
            let (q, fraction) = digits(p + 1);
            if fraction == 0 {
                return None;
            }
            significant += fraction;
            p = q;
        }
        if matches!(buf.get(p), Some(b'e' | b'E')) {
            p += 1;
            if matches!(buf.get(p), Some(b'+' | b'-')) {
                p += 1;
            }
            let (q, exponent) = digits(p);
            if exponent == 0 || exponent > 3 {
                return None;
            }
            p = q;
        }
        // past 17 significant digits two correct parsers still agree, but nothing the writer
        // gives needs them: such numbers go to the reference
        if significant > 17 {
            return None;
        }
        let value: f64 = std::str::from_utf8(&buf[start..p]).ok()?.parse().ok()?;
        self.p = p;
        Some(value)
    }

    /// A JSON integer of at most 19 digits without a sign or leading zero.
    #[inline]
    fn integer(&mut self) -> Option<u64> {
        let start = self.p;
        let mut value: u64 = 0;
        while let Some(&c) = self.buf.get(self.p) {
            if !c.is_ascii_digit() {
                break;
            }
            value = value.checked_mul(10)?.checked_add(u64::from(c - b'0'))?;
            self.p += 1;
        }
        let len = self.p - start;
        if len == 0 || len > 19 || (len > 1 && self.buf[start] == b'0') {
            return None;
        }
        Some(value)
    }

    /// A count as `_read_rounds` reads it: one or two digits, no leading zero.
    #[inline]
    fn count(&mut self) -> Option<u8> {
        let first = self.byte()?;
        if !first.is_ascii_digit() {
            return None;
        }
        match self.buf.get(self.p) {
            Some(&second) if second.is_ascii_digit() => {
                if first == b'0' {
                    return None;
                }
                self.p += 1;
                Some((first - b'0') * 10 + (second - b'0'))
            }
            _ => Some(first - b'0'),
        }
    }
}

/// One step read from its line: its header and rounds, names as spans of the line.
struct Step<'a> {
    ts: f64,
    worker: &'a [u8],
    seq: u64,
    bundle: &'a [u8],
    draft_ms: f64,
    verify_ms: f64,
    kv_usage: f64,
    rounds: Vec<(&'a [u8], &'a [u8], &'a [u8], u8, u8)>,
}

/// The walk's constants (the contract's bounds and the scope key's reserved names) and its reader.
#[pyclass(frozen, module = "specwatch_native")]
pub struct LineWalk {
    max_line_bytes: usize,
    names: NameRules,
    max_requests: usize,
    max_draft_tokens: u8,
    max_exact_int: f64,
}

impl LineWalk {
    /// The step on ``line`` if it is one in the writer's layout that passes every check.
    fn step<'a>(&self, line: &'a [u8]) -> Option<Step<'a>> {
        if line.len() > self.max_line_bytes {
            return None;
        }
        let names = &self.names;
        let mut c = Cursor { buf: line, p: 0 };
        c.literal(br#"{"v":1,"ts":"#)?;
        let ts = c.number()?;
        c.literal(br#","kind":"step","worker":""#)?;
        let worker = c.name(names)?;
        c.literal(br#","seq":"#)?;
        let seq = c.integer()?;
        c.literal(br#","bundle_id":""#)?;
        let bundle = c.name(names)?;
        c.literal(br#","draft_ms":"#)?;
        let draft_ms = c.number()?;
        c.literal(br#","verify_ms":"#)?;
        let verify_ms = c.number()?;
        c.literal(br#","kv_usage":"#)?;
        let kv_usage = c.number()?;
        c.literal(br#","requests":["#)?;
        let mut rounds = Vec::new();
        if c.buf.get(c.p) == Some(&b']') {
            c.p += 1;
        } else {
            loop {
                c.literal(br#"{"id":""#)?;
                let id = c.name(names)?;
                c.literal(br#","bucket":""#)?;
                let bucket = c.name(names)?;
                c.literal(br#","cohort":""#)?;
                let cohort = c.name(names)?;
                c.literal(br#","drafted":"#)?;
                let drafted = c.count()?;
                c.literal(br#","accepted":"#)?;
                let accepted = c.count()?;
                c.literal(b"}")?;
                if drafted > self.max_draft_tokens || accepted > drafted || !self.names.scope_ok(bucket) || !self.names.scope_ok(cohort) {
                    return None;
                }
                rounds.push((id, bucket, cohort, drafted, accepted));
                if rounds.len() > self.max_requests {
                    return None;
                }
                match c.byte()? {
                    b',' => continue,
                    b']' => break,
                    _ => return None,
                }
            }
        }
        c.literal(b"}")?;
        if !line[c.p..].iter().all(|&b| blank(b)) {
            return None;
        }
        let time = |x: f64| (0.0..f64::INFINITY).contains(&x);
        if !(ts < self.max_exact_int && time(ts) && time(draft_ms) && time(verify_ms) && (0.0..=1.0).contains(&kv_usage))
            || seq >= 1 << 63
        {
            return None;
        }
        Some(Step { ts, worker, seq, bundle, draft_ms, verify_ms, kv_usage, rounds })
    }
}

/// One `str` per distinct name of the block (printable ASCII, so UTF-8 as it is).
fn interned<'a, 'py>(py: Python<'py>, names: &mut FxMap<&'a [u8], Bound<'py, PyString>>, name: &'a [u8]) -> Bound<'py, PyString> {
    names
        .entry(name)
        .or_insert_with(|| PyString::new(py, std::str::from_utf8(name).unwrap_or_default()))
        .clone()
}

// bytearrays, so that the arrays numpy lays over them are writable as the reference's are
fn f64_bytes<'py>(py: Python<'py>, values: &[f64]) -> Bound<'py, PyByteArray> {
    let raw: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
    PyByteArray::new(py, &raw)
}

fn i64_bytes<'py>(py: Python<'py>, values: &[i64]) -> Bound<'py, PyByteArray> {
    let raw: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
    PyByteArray::new(py, &raw)
}

#[pymethods]
impl LineWalk {
    #[new]
    fn new(
        max_line_bytes: usize,
        max_name_chars: usize,
        max_requests: usize,
        max_draft_tokens: u8,
        max_exact_int: f64,
        every: Vec<u8>,
        separator: u8,
    ) -> Self {
        let names = NameRules { max_chars: max_name_chars, every, separator };
        LineWalk { max_line_bytes, names, max_requests, max_draft_tokens, max_exact_int }
    }

    /// The steps of a block of lines (bytes) read here, as columns, and the positions left
    /// to the reference: ``(at, declined, ts, workers, seqs, bundles, draft_ms, verify_ms,
    /// kv_usage, step_ids, round_step, pair_index, pairs, drafted, accepted)``. Floats and
    /// indices come as native-endian float64 / int64 bytearrays, counts as one byte each; pairs
    /// (bucket, cohort) are numbered in the order the steps first list them, and a step
    /// listing the same ids as one before it shares that step's tuple.
    fn block<'py>(&self, py: Python<'py>, lines: &Bound<'py, PyList>) -> PyResult<Bound<'py, PyTuple>> {
        let held: Vec<Option<Bound<'py, PyBytes>>> =
            lines.iter().map(|line| line.cast_into::<PyBytes>().ok()).collect();
        let mut at = Vec::new();
        let mut declined = Vec::new();
        let (mut ts, mut draft_ms, mut verify_ms, mut kv_usage) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let workers = PyList::empty(py);
        let bundles = PyList::empty(py);
        let step_ids = PyList::empty(py);
        let mut seqs = Vec::new();
        let mut round_step = Vec::new();
        let mut pair_index = Vec::new();
        let (mut drafted, mut accepted) = (Vec::new(), Vec::new());
        let mut names: FxMap<&[u8], Bound<'py, PyString>> = FxMap::default();
        let mut pair_numbers: FxMap<(&[u8], &[u8]), i64> = FxMap::default();
        let pairs = PyList::empty(py);
        let mut id_tuples: FxMap<Vec<&[u8]>, Bound<'py, PyTuple>> = FxMap::default();
        let mut ids: Vec<&[u8]> = Vec::new();
        for (position, line) in held.iter().enumerate() {
            let Some(step) = line.as_ref().and_then(|line| self.step(line.as_bytes())) else {
                declined.push(position);
                continue;
            };
            let row = at.len() as i64;
            at.push(position);
            ts.push(step.ts);
            draft_ms.push(step.draft_ms);
            verify_ms.push(step.verify_ms);
            kv_usage.push(step.kv_usage);
            workers.append(interned(py, &mut names, step.worker))?;
            bundles.append(interned(py, &mut names, step.bundle))?;
            seqs.push(step.seq);
            ids.clear();
            for &(id, bucket, cohort, d, a) in &step.rounds {
                ids.push(id);
                let next = pair_numbers.len() as i64;
                let number = *pair_numbers.entry((bucket, cohort)).or_insert_with(|| next);
                if number == next {
                    let pair = (interned(py, &mut names, bucket), interned(py, &mut names, cohort));
                    pairs.append(pair)?;
                }
                pair_index.push(number);
                round_step.push(row);
                drafted.push(d);
                accepted.push(a);
            }
            let tuple = match id_tuples.get(&ids) {
                Some(tuple) => tuple.clone(),
                None => {
                    let made = PyTuple::new(py, ids.iter().map(|&id| interned(py, &mut names, id)))?;
                    id_tuples.insert(ids.clone(), made.clone());
                    made
                }
            };
            step_ids.append(tuple)?;
        }
        let parts: [Bound<'py, PyAny>; 15] = [
            at.into_pyobject(py)?.into_any(),
            declined.into_pyobject(py)?.into_any(),
            f64_bytes(py, &ts).into_any(),
            workers.into_any(),
            seqs.into_pyobject(py)?.into_any(),
            bundles.into_any(),
            f64_bytes(py, &draft_ms).into_any(),
            f64_bytes(py, &verify_ms).into_any(),
            f64_bytes(py, &kv_usage).into_any(),
            step_ids.into_any(),
            i64_bytes(py, &round_step).into_any(),
            i64_bytes(py, &pair_index).into_any(),
            pairs.into_any(),
            PyByteArray::new(py, &drafted).into_any(),
            PyByteArray::new(py, &accepted).into_any(),
        ];
        PyTuple::new(py, parts)
    }
}
