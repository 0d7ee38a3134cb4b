//! The single-pass RFC 8785 canonicaliser behind [`super::canonical_json`]:
//! one walk over the bytes that checks what the `Value` path checks
//! ([`super::canonical_json_via_value`]: serde_json's grammar and limits,
//! the I-JSON rules, numbers that fit doubles) and writes the canonical
//! form as it goes, into reusable buffers.
//!
//! Its output is, byte for byte, the `Value` path's output, `None` for the
//! same texts (proptests against the `Value` path in the parent module):
//!
//! - Grammar as serde_json's `from_slice`: whitespace is space, tab, LF,
//!   CR; no trailing commas, no trailing characters; strings are valid
//!   UTF-8 without raw control characters (below U+0020), escapes are the
//!   JSON ones, a `\u` surrogate must be a leading one followed at once by
//!   a `\u` trailing one; containers nest at most 127 deep (serde_json's
//!   recursion limit of 128 counts the container that fails).
//! - I-JSON as the `Strict` visitor: no duplicate member name (compared
//!   decoded), no member name starting with serde_json's private prefix, no
//!   number of magnitude 2^53 or more, and every number passes
//!   [`fits_double`].
//! - Output as `serde_json_canonicalizer`: members sorted by the UTF-16
//!   code units of their decoded names; strings escaped as serde_json
//!   escapes them (`\"`, `\\`, `\b`, `\t`, `\n`, `\f`, `\r`, other
//!   controls as `\u00xx`, everything else as UTF-8); numbers as
//!   `ryu_js` writes their double, except integer literals (below 2^53),
//!   which are their own ECMAScript form and are copied (`-0` is `0`), and
//!   plain decimals of at most 15 significant digits from 1e-6 on, which
//!   are too once their trailing zeros are dropped ([`plain_decimal`]).
//!
//! A non-integer number is read by serde_json itself (the parser the
//! `Value` path uses); should it refuse a literal this grammar accepted,
//! the canonicaliser is unsure and the `Value` path answers instead.

use std::cell::RefCell;
use std::cmp::Ordering;

use super::{
    canonical_json_via_value, fits_double, short_plain_decimal, EXACT_LIMIT, SERDE_JSON_PRIVATE,
};

/// serde_json's recursion limit: the container that brings the remaining
/// depth to 0 fails.
const RECURSION_LIMIT: u32 = 128;

/// Buffers above this capacity are not kept for the next body.
const KEEP_CAPACITY: usize = 256 * 1024;

/// Why a text has no canonical form here.
#[derive(Debug, PartialEq, Eq)]
enum Fail {
    /// Not I-JSON, or a number more precise than a double: `None`.
    NotIJson,
    /// Something this parser does not decide: ask the `Value` path.
    Unsure,
}

type Res<T = ()> = Result<T, Fail>;

/// One member of an object being written: its decoded name
/// (`keys[name.0..name.1]`) and its `"name":value` in `out`.
#[derive(Debug, Clone, Copy)]
struct Member {
    name: (usize, usize),
    start: usize,
    end: usize,
}

/// Reusable buffers.
#[derive(Debug, Default)]
pub(super) struct Canonicaliser {
    /// The canonical form.
    out: Vec<u8>,
    /// Decoded member names of the objects open.
    keys: Vec<u8>,
    /// Members of the objects open.
    members: Vec<Member>,
    /// A decoded string with escapes; an object's members while they are
    /// reordered.
    tmp: Vec<u8>,
}

thread_local! {
    static BUFFERS: RefCell<Canonicaliser> = RefCell::default();
}

impl Canonicaliser {
    /// Fresh buffers, room for `n` bytes of output (a canonical form is
    /// seldom longer than its text).
    pub(super) fn with_output_capacity(n: usize) -> Self {
        Self {
            out: Vec::with_capacity(n),
            ..Self::default()
        }
    }

    /// Canonicalises `body` into `self.out`; false when it has no
    /// canonical form (the `Value` path would say `None`).
    pub(super) fn canonicalise(&mut self, body: &[u8]) -> bool {
        self.out.clear();
        self.keys.clear();
        self.members.clear();
        let mut p = Parser { b: body, i: 0 };
        match p.document(self) {
            Ok(()) => true,
            Err(Fail::NotIJson) => false,
            Err(Fail::Unsure) => match canonical_json_via_value(body) {
                Some(c) => {
                    self.out = c;
                    true
                }
                None => false,
            },
        }
    }

    /// The canonical form of the last [`Self::canonicalise`] that said
    /// true.
    pub(super) fn output(&self) -> &[u8] {
        &self.out
    }

    /// Takes the canonical form out.
    pub(super) fn into_output(self) -> Vec<u8> {
        self.out
    }

    /// Runs `f` with this thread's buffers (fresh ones if they are in
    /// use), then drops buffers grown too large to keep.
    pub(super) fn with_thread_buffers<R>(f: impl FnOnce(&mut Canonicaliser) -> R) -> R {
        BUFFERS.with(|cell| match cell.try_borrow_mut() {
            Ok(mut c) => {
                let r = f(&mut c);
                if c.out.capacity() > KEEP_CAPACITY
                    || c.keys.capacity() > KEEP_CAPACITY
                    || c.tmp.capacity() > KEEP_CAPACITY
                    || c.members.capacity() > KEEP_CAPACITY / std::mem::size_of::<Member>()
                {
                    *c = Canonicaliser::default();
                }
                r
            }
            Err(_) => f(&mut Canonicaliser::default()),
        })
    }
}

/// Order of two decoded member names (valid UTF-8) by their UTF-16 code
/// units (RFC 8785 §3.2.3).
///
/// UTF-8 byte order is code point order, which is UTF-16 order except
/// between a supplementary character (4-byte UTF-8, lead `F0`–`F4`;
/// surrogates `D800`–`DFFF` in UTF-16) and one of `U+E000`–`U+FFFF`
/// (lead `EE`, `EF`). Two names first differ at the same offset of a
/// character in both (their common prefix ends on the same boundary), at
/// its lead byte when the two characters differ in length.
fn utf16_order(a: &[u8], b: &[u8]) -> Ordering {
    match a.iter().zip(b).position(|(x, y)| x != y) {
        None => a.len().cmp(&b.len()),
        Some(k) => {
            let (x, y) = (a[k], b[k]);
            let high_bmp = |c: u8| c == 0xEE || c == 0xEF;
            if x >= 0xF0 && high_bmp(y) {
                Ordering::Less
            } else if high_bmp(x) && y >= 0xF0 {
                Ordering::Greater
            } else {
                x.cmp(&y)
            }
        }
    }
}

/// Writes the ECMAScript form (`Number::toString`) of a literal without
/// exponent that [`short_plain_decimal`] accepts, `-` aside (`digits` is
/// `int.frac`), unless it is below 1e-6 (written with an exponent: false,
/// nothing written).
///
/// Such a literal is the shortest decimal of its double (the module docs
/// of the parent), so `ryu_js` would write its digits, trailing zeros
/// dropped; below 1e21 and from 1e-6 on, ECMAScript writes them without
/// exponent. Its integer part has at most 15 digits: below 2^53.
fn plain_decimal(c: &mut Canonicaliser, negative: bool, digits: &[u8]) -> bool {
    let (int, frac) = match digits.iter().position(|&d| d == b'.') {
        Some(dot) => (&digits[..dot], &digits[dot + 1..]),
        None => (digits, &digits[digits.len()..]),
    };
    let significant = frac.len() - frac.iter().rev().take_while(|&&d| d == b'0').count();
    let frac = &frac[..significant];
    if int == b"0" {
        if frac.is_empty() {
            // 0, -0, 0.000, -0.0: 0.
            c.out.push(b'0');
            return true;
        }
        if frac.iter().take_while(|&&d| d == b'0').count() >= 6 {
            return false;
        }
    }
    if negative {
        c.out.push(b'-');
    }
    c.out.extend_from_slice(int);
    if !frac.is_empty() {
        c.out.push(b'.');
        c.out.extend_from_slice(frac);
    }
    true
}

/// Writes decoded string content `s` as serde_json escapes it, quotes
/// included.
fn write_escaped(out: &mut Vec<u8>, s: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    let mut from = 0;
    for (i, &c) in s.iter().enumerate() {
        let esc: &[u8] = match c {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x09 => b"\\t",
            0x0A => b"\\n",
            0x0C => b"\\f",
            0x0D => b"\\r",
            0x00..=0x1F => &[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[usize::from(c >> 4)],
                HEX[usize::from(c & 0xF)],
            ],
            _ => continue,
        };
        out.extend_from_slice(&s[from..i]);
        out.extend_from_slice(esc);
        from = i + 1;
    }
    out.extend_from_slice(&s[from..]);
    out.push(b'"');
}

struct Parser<'a> {
    b: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\t' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    /// The whole text: one value, whitespace around it.
    fn document(&mut self, c: &mut Canonicaliser) -> Res {
        self.value(c, RECURSION_LIMIT)?;
        self.skip_ws();
        if self.i == self.b.len() {
            Ok(())
        } else {
            Err(Fail::NotIJson)
        }
    }

    /// A value (whitespace before it), written to `c.out`; `depth` is
    /// serde_json's remaining depth.
    fn value(&mut self, c: &mut Canonicaliser, depth: u32) -> Res {
        self.skip_ws();
        match self.peek() {
            Some(b'{') => self.object(c, depth - 1),
            Some(b'[') => self.array(c, depth - 1),
            Some(b'"') => {
                let Canonicaliser { out, tmp, .. } = c;
                self.string(out, tmp, false)
            }
            Some(b't') => self.literal(c, b"true"),
            Some(b'f') => self.literal(c, b"false"),
            Some(b'n') => self.literal(c, b"null"),
            Some(b'-' | b'0'..=b'9') => self.number(c),
            _ => Err(Fail::NotIJson),
        }
    }

    fn literal(&mut self, c: &mut Canonicaliser, word: &[u8]) -> Res {
        if self.b[self.i..].starts_with(word) {
            self.i += word.len();
            c.out.extend_from_slice(word);
            Ok(())
        } else {
            Err(Fail::NotIJson)
        }
    }

    fn array(&mut self, c: &mut Canonicaliser, depth: u32) -> Res {
        if depth == 0 {
            return Err(Fail::NotIJson);
        }
        self.i += 1;
        c.out.push(b'[');
        self.skip_ws();
        if self.peek() == Some(b']') {
            self.i += 1;
            c.out.push(b']');
            return Ok(());
        }
        loop {
            self.value(c, depth)?;
            self.skip_ws();
            match self.peek() {
                Some(b',') => {
                    self.i += 1;
                    c.out.push(b',');
                }
                Some(b']') => {
                    self.i += 1;
                    c.out.push(b']');
                    return Ok(());
                }
                _ => return Err(Fail::NotIJson),
            }
        }
    }

    fn object(&mut self, c: &mut Canonicaliser, depth: u32) -> Res {
        if depth == 0 {
            return Err(Fail::NotIJson);
        }
        self.i += 1;
        c.out.push(b'{');
        let body = c.out.len();
        let first = c.members.len();
        let keys = c.keys.len();
        self.skip_ws();
        if self.peek() == Some(b'}') {
            self.i += 1;
            c.out.push(b'}');
            return Ok(());
        }
        loop {
            self.skip_ws();
            if self.peek() != Some(b'"') {
                return Err(Fail::NotIJson);
            }
            let start = c.out.len();
            let name_start = c.keys.len();
            {
                let Canonicaliser { out, keys, .. } = c;
                self.string(out, keys, true)?;
            }
            if c.keys[name_start..].starts_with(SERDE_JSON_PRIVATE.as_bytes()) {
                return Err(Fail::NotIJson);
            }
            let name = (name_start, c.keys.len());
            self.skip_ws();
            if self.peek() != Some(b':') {
                return Err(Fail::NotIJson);
            }
            self.i += 1;
            c.out.push(b':');
            self.value(c, depth)?;
            c.members.push(Member {
                name,
                start,
                end: c.out.len(),
            });
            self.skip_ws();
            match self.peek() {
                Some(b',') => {
                    self.i += 1;
                    c.out.push(b',');
                }
                Some(b'}') => {
                    self.i += 1;
                    break;
                }
                _ => return Err(Fail::NotIJson),
            }
        }
        let Canonicaliser {
            out,
            keys: names,
            members,
            tmp,
        } = c;
        let ms = &mut members[first..];
        let order = |a: &Member, b: &Member| {
            utf16_order(&names[a.name.0..a.name.1], &names[b.name.0..b.name.1])
        };
        if !ms.windows(2).all(|w| order(&w[0], &w[1]) == Ordering::Less) {
            ms.sort_unstable_by(order);
            if ms
                .windows(2)
                .any(|w| order(&w[0], &w[1]) == Ordering::Equal)
            {
                return Err(Fail::NotIJson);
            }
            tmp.clear();
            tmp.extend_from_slice(&out[body..]);
            out.truncate(body);
            for (n, m) in ms.iter().enumerate() {
                if n > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(&tmp[m.start - body..m.end - body]);
            }
        }
        out.push(b'}');
        members.truncate(first);
        names.truncate(keys);
        Ok(())
    }

    /// A string (at its opening quote): written to `out` in canonical
    /// form. With `keep`, its decoded content is appended to `decoded`;
    /// else `decoded` is scratch space.
    fn string(&mut self, out: &mut Vec<u8>, decoded: &mut Vec<u8>, keep: bool) -> Res {
        self.i += 1;
        let start = self.i;
        // The plain run: no escape, no quote, no control character.
        while let Some(&ch) = self.b.get(self.i) {
            if ch == b'"' || ch == b'\\' || ch < 0x20 {
                break;
            }
            self.i += 1;
        }
        match self.peek() {
            Some(b'"') => {
                let s = &self.b[start..self.i];
                if std::str::from_utf8(s).is_err() {
                    return Err(Fail::NotIJson);
                }
                self.i += 1;
                out.push(b'"');
                out.extend_from_slice(s);
                out.push(b'"');
                if keep {
                    decoded.extend_from_slice(s);
                }
                Ok(())
            }
            Some(b'\\') => {
                let base = if keep {
                    decoded.len()
                } else {
                    decoded.clear();
                    0
                };
                decoded.extend_from_slice(&self.b[start..self.i]);
                self.escaped_rest(decoded)?;
                if std::str::from_utf8(&decoded[base..]).is_err() {
                    return Err(Fail::NotIJson);
                }
                write_escaped(out, &decoded[base..]);
                Ok(())
            }
            // A control character, or the end of the text.
            _ => Err(Fail::NotIJson),
        }
    }

    /// The rest of a string from an escape on, decoded into `decoded`,
    /// through its closing quote.
    fn escaped_rest(&mut self, decoded: &mut Vec<u8>) -> Res {
        loop {
            let Some(ch) = self.peek() else {
                return Err(Fail::NotIJson);
            };
            self.i += 1;
            match ch {
                b'"' => return Ok(()),
                b'\\' => {
                    let Some(e) = self.peek() else {
                        return Err(Fail::NotIJson);
                    };
                    self.i += 1;
                    match e {
                        b'"' => decoded.push(b'"'),
                        b'\\' => decoded.push(b'\\'),
                        b'/' => decoded.push(b'/'),
                        b'b' => decoded.push(0x08),
                        b'f' => decoded.push(0x0C),
                        b'n' => decoded.push(b'\n'),
                        b'r' => decoded.push(b'\r'),
                        b't' => decoded.push(b'\t'),
                        b'u' => {
                            let n = self.hex4()?;
                            let code = match n {
                                0xDC00..=0xDFFF => return Err(Fail::NotIJson),
                                0xD800..=0xDBFF => {
                                    if !self.b[self.i..].starts_with(b"\\u") {
                                        return Err(Fail::NotIJson);
                                    }
                                    self.i += 2;
                                    let n2 = self.hex4()?;
                                    if !(0xDC00..=0xDFFF).contains(&n2) {
                                        return Err(Fail::NotIJson);
                                    }
                                    (((n - 0xD800) << 10) | (n2 - 0xDC00)) + 0x1_0000
                                }
                                _ => n,
                            };
                            let Some(ch) = char::from_u32(code) else {
                                return Err(Fail::Unsure);
                            };
                            let mut buf = [0; 4];
                            decoded.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                        }
                        _ => return Err(Fail::NotIJson),
                    }
                }
                0x00..=0x1F => return Err(Fail::NotIJson),
                _ => decoded.push(ch),
            }
        }
    }

    /// Four hex digits of a `\u` escape.
    fn hex4(&mut self) -> Res<u32> {
        let Some(digits) = self.b.get(self.i..self.i + 4) else {
            return Err(Fail::NotIJson);
        };
        let mut n = 0;
        for &d in digits {
            let Some(v) = char::from(d).to_digit(16) else {
                return Err(Fail::NotIJson);
            };
            n = n * 16 + v;
        }
        self.i += 4;
        Ok(n)
    }

    /// A number (at its first character), by JSON's grammar; written in
    /// its ECMAScript form.
    fn number(&mut self, c: &mut Canonicaliser) -> Res {
        let b = self.b;
        let start = self.i;
        let digits = |i: &mut usize| {
            let from = *i;
            while b.get(*i).is_some_and(u8::is_ascii_digit) {
                *i += 1;
            }
            *i - from
        };
        let mut i = self.i;
        let negative = b[i] == b'-';
        if negative {
            i += 1;
        }
        let int_start = i;
        match b.get(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => {
                digits(&mut i);
            }
            _ => return Err(Fail::NotIJson),
        }
        let int_end = i;
        let mut integer = true;
        if b.get(i) == Some(&b'.') {
            i += 1;
            integer = false;
            if digits(&mut i) == 0 {
                return Err(Fail::NotIJson);
            }
        }
        if let Some(b'e' | b'E') = b.get(i) {
            i += 1;
            integer = false;
            if let Some(b'+' | b'-') = b.get(i) {
                i += 1;
            }
            if digits(&mut i) == 0 {
                return Err(Fail::NotIJson);
            }
        }
        self.i = i;
        let text = &b[start..i];
        // ASCII by construction.
        let Ok(text_str) = std::str::from_utf8(text) else {
            return Err(Fail::Unsure);
        };
        if integer {
            let int = &b[int_start..int_end];
            // 17 digits or more: 1e16 or more, beyond 2^53.
            if int.len() > 16 {
                return Err(Fail::NotIJson);
            }
            let magnitude = int
                .iter()
                .fold(0u64, |acc, &d| acc * 10 + u64::from(d - b'0'));
            if magnitude >= EXACT_LIMIT || !fits_double(text_str) {
                return Err(Fail::NotIJson);
            }
            if magnitude == 0 {
                c.out.push(b'0');
            } else {
                c.out.extend_from_slice(text);
            }
            return Ok(());
        }
        if short_plain_decimal(text_str) && plain_decimal(c, negative, &b[int_start..i]) {
            return Ok(());
        }
        if !fits_double(text_str) {
            return Err(Fail::NotIJson);
        }
        let Ok(double) = serde_json::from_slice::<f64>(text) else {
            return Err(Fail::Unsure);
        };
        if !double.is_finite() {
            return Err(Fail::Unsure);
        }
        if double.abs() >= EXACT_LIMIT as f64 {
            return Err(Fail::NotIJson);
        }
        let mut buf = ryu_js::Buffer::new();
        c.out
            .extend_from_slice(buf.format_finite(double).as_bytes());
        Ok(())
    }
}
