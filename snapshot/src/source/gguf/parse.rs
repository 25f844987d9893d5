//! GGUF container parsing (versions 2 and 3): metadata key/values and tensor infos.
//! Every length is checked against the bytes that remain before anything is
//! allocated, so a hostile file cannot make the parser allocate or read past its end.

use std::collections::BTreeMap;

use crate::{Error, Result};

use super::dequant::GgmlType;

const MAGIC: &[u8; 4] = b"GGUF";
const MAX_DIMS: u32 = 4;
const MAX_ARRAY_NESTING: u32 = 3;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetaValue {
    /// Any integer type that fits a u64.
    #[must_use]
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    #[must_use]
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
    #[must_use]
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }
    #[must_use]
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }
    #[must_use]
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor's description; `offset` is relative to the data section.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: `dims[0]` is the fastest-varying (row length).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte range in the file.
    pub start: usize,
    pub len: usize,
}

impl TensorInfo {
    #[must_use]
    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }
    /// Row-major shape, outermost first (the reverse of GGML's order).
    #[must_use]
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }
}

/// The parsed header of a GGUF file.
#[derive(Clone, Debug, Default)]
pub struct GgufHeader {
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
}

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

fn err(msg: impl Into<String>) -> Error {
    Error::InvalidGguf(msg.into())
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.b.len() - self.pos
    }
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(err(format!(
                "truncated reading {what} at byte {} ({n} bytes wanted, {} left)",
                self.pos,
                self.remaining()
            )));
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.take(N, what)?.try_into().expect("took N bytes"))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }
    /// A length that must describe at least `min_each` bytes per item still in the file.
    fn len(&mut self, min_each: usize, what: &str) -> Result<usize> {
        let n = self.u64(what)?;
        let fits = usize::try_from(n).ok().filter(|&n| {
            n.checked_mul(min_each)
                .is_some_and(|b| b <= self.remaining())
        });
        fits.ok_or_else(|| {
            err(format!(
                "{what} claims {n} items, more than the {} bytes left hold",
                self.remaining()
            ))
        })
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.len(1, what)?;
        let bytes = self.take(n, what)?;
        // Token strings in real files are not always valid UTF-8 (byte tokens); keep
        // them rather than fail, replacement characters are what tokenizers would see.
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }
    fn value(&mut self, ty: u32, depth: u32, what: &str) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U8(self.arr::<1>(what)?[0]),
            1 => MetaValue::I8(self.arr::<1>(what)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.arr(what)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.arr(what)?)),
            4 => MetaValue::U32(self.u32(what)?),
            5 => MetaValue::I32(i32::from_le_bytes(self.arr(what)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.arr(what)?)),
            7 => match self.arr::<1>(what)?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(err(format!("{what}: bool byte {b}"))),
            },
            8 => MetaValue::String(self.string(what)?),
            9 => {
                if depth >= MAX_ARRAY_NESTING {
                    return Err(err(format!("{what}: arrays nested too deeply")));
                }
                let ety = self.u32(what)?;
                let n = self.len(min_size(ety).ok_or_else(|| bad_type(ety, what))?, what)?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(ety, depth + 1, what)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::U64(self.u64(what)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.arr(what)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.arr(what)?)),
            other => return Err(bad_type(other, what)),
        })
    }
}

fn bad_type(ty: u32, what: &str) -> Error {
    err(format!("{what}: unknown metadata value type {ty}"))
}

/// Smallest encoding of a value of type `ty`, used to bound array lengths.
fn min_size(ty: u32) -> Option<usize> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,
        9 => 12,
        10..=12 => 8,
        _ => return None,
    })
}

/// Parses a whole GGUF image. Tensor byte ranges are checked to lie inside `b`.
pub fn parse(b: &[u8]) -> Result<GgufHeader> {
    let mut c = Cursor { b, pos: 0 };
    if c.take(4, "magic")? != MAGIC {
        return Err(err("bad magic (not a GGUF file)"));
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(Error::Unsupported(format!(
            "GGUF version {version} (2 and 3 are read)"
        )));
    }
    // 24 = the smallest tensor info (empty name, 1 dim, type, offset) … and 12 the
    // smallest key/value; this rejects absurd counts before any allocation.
    let n_tensors = c.len(24, "tensor count")?;
    let n_kv = c.len(12, "metadata count")?;
    let mut metadata = BTreeMap::new();
    for _ in 0..n_kv {
        let key = c.string("metadata key")?;
        let ty = c.u32("metadata type")?;
        let v = c.value(ty, 0, &key)?;
        metadata.insert(key, v);
    }
    let mut raw = Vec::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = c.string("tensor name")?;
        let nd = c.u32("tensor dims")?;
        if nd == 0 || nd > MAX_DIMS {
            return Err(err(format!("tensor {name}: {nd} dimensions")));
        }
        let mut dims = Vec::with_capacity(nd as usize);
        for _ in 0..nd {
            dims.push(c.u64("tensor dim")?);
        }
        let ty_id = c.u32("tensor type")?;
        let ty = GgmlType::from_id(ty_id)
            .ok_or_else(|| Error::Unsupported(format!("tensor {name}: GGML type {ty_id}")))?;
        let off = c.u64("tensor offset")?;
        raw.push((name, dims, ty, off));
    }
    let alignment = match metadata.get("general.alignment") {
        None => 32,
        Some(v) => v
            .as_u64()
            .filter(|a| a.is_power_of_two())
            .ok_or_else(|| err("general.alignment is not a power of two"))?,
    };
    let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
    let mut tensors = Vec::with_capacity(raw.len());
    for (name, dims, ty, off) in raw {
        let numel = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let nbytes = numel.and_then(|n| ty.bytes_for(n, dims[0]));
        let Some(nbytes) = nbytes else {
            return Err(err(format!(
                "tensor {name}: dims {dims:?} invalid for {ty:?} (overflow or rows not a whole number of blocks)"
            )));
        };
        if off % alignment != 0 {
            return Err(err(format!(
                "tensor {name}: offset {off} not {alignment}-aligned"
            )));
        }
        let start = data_start.checked_add(off);
        let end = start.and_then(|s| s.checked_add(nbytes));
        match (start, end) {
            (Some(s), Some(e)) if e <= b.len() as u64 => tensors.push(TensorInfo {
                name,
                dims,
                ty,
                start: s as usize,
                len: nbytes as usize,
            }),
            _ => {
                return Err(err(format!(
                    "tensor {name}: {nbytes} bytes at data offset {off} run past the end of the {}-byte file",
                    b.len()
                )));
            }
        }
    }
    Ok(GgufHeader {
        version,
        metadata,
        tensors,
    })
}
