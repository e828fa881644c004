//! The one encoding of every message ranks exchange: little-endian integers, fixed byte
//! arrays, and length-prefixed strings, byte strings and lists.
//!
//! A message type implements [`Wire`] by putting its fields in order ([`Writer::put`]) and
//! taking them back in the same order ([`Reader::take`]). Decoding never panics and never
//! allocates more than the bytes it was given: a length prefix is checked against the bytes
//! that remain before anything is reserved. The setup messages (hello, limits, topology
//! rows, votes), the NCCL bootstrap's frames and the socket store's frames all use it, and so
//! does symm-bench (through the hidden `__codec` re-export; not a stable API).

/// A value with a wire form.
pub trait Wire: Sized {
    /// Appends the wire form.
    fn put(&self, w: &mut Writer);
    /// Reads one value (`None`: truncated or malformed).
    fn take(r: &mut Reader<'_>) -> Option<Self>;

    /// The wire form as a new buffer.
    fn to_wire(&self) -> Vec<u8> {
        let mut w = Writer::default();
        self.put(&mut w);
        w.finish()
    }

    /// Decodes exactly one value: trailing bytes are malformed.
    fn from_wire(bytes: &[u8]) -> Option<Self> {
        let mut r = Reader::new(bytes);
        let v = r.take()?;
        r.is_empty().then_some(v)
    }
}

/// Builds a message.
#[derive(Debug, Default)]
pub struct Writer(Vec<u8>);

impl Writer {
    /// With room for `bytes` bytes.
    pub fn with_capacity(bytes: usize) -> Self {
        Writer(Vec::with_capacity(bytes))
    }

    /// Appends `v`'s wire form.
    pub fn put<T: Wire>(&mut self, v: &T) -> &mut Self {
        v.put(self);
        self
    }

    /// Appends bytes as they are (no length prefix): a message's tail.
    pub fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.extend_from_slice(bytes);
        self
    }

    /// The message.
    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.0)
    }
}

/// Reads a message front to back.
#[derive(Debug, Clone)]
pub struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Reader(bytes)
    }

    /// The next value.
    pub fn take<T: Wire>(&mut self) -> Option<T> {
        T::take(self)
    }

    /// The next `n` bytes.
    pub fn raw(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.0.len() {
            return None;
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Some(head)
    }

    /// Bytes left.
    pub fn remaining(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

macro_rules! wire_int {
    ($($t:ty),*) => {$(
        impl Wire for $t {
            fn put(&self, w: &mut Writer) {
                w.raw(&self.to_le_bytes());
            }
            fn take(r: &mut Reader<'_>) -> Option<Self> {
                Some(<$t>::from_le_bytes(r.raw(std::mem::size_of::<$t>())?.try_into().ok()?))
            }
        }
    )*};
}
wire_int!(u8, u16, u32, u64);

impl Wire for bool {
    fn put(&self, w: &mut Writer) {
        w.put(&(*self as u8));
    }
    fn take(r: &mut Reader<'_>) -> Option<Self> {
        match r.take::<u8>()? {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        }
    }
}

/// `f64` travels as its IEEE bits (NaN payloads included).
impl Wire for f64 {
    fn put(&self, w: &mut Writer) {
        w.put(&self.to_bits());
    }
    fn take(r: &mut Reader<'_>) -> Option<Self> {
        Some(f64::from_bits(r.take()?))
    }
}

/// `usize` travels as `u64`; a value that does not fit this platform is malformed.
impl Wire for usize {
    fn put(&self, w: &mut Writer) {
        w.put(&(*self as u64));
    }
    fn take(r: &mut Reader<'_>) -> Option<Self> {
        usize::try_from(r.take::<u64>()?).ok()
    }
}

impl<const N: usize> Wire for [u8; N] {
    fn put(&self, w: &mut Writer) {
        w.raw(self);
    }
    fn take(r: &mut Reader<'_>) -> Option<Self> {
        r.raw(N)?.try_into().ok()
    }
}

/// `0: u8` or `1: u8` then the value.
impl<T: Wire> Wire for Option<T> {
    fn put(&self, w: &mut Writer) {
        match self {
            None => w.put(&0u8),
            Some(v) => w.put(&1u8).put(v),
        };
    }
    fn take(r: &mut Reader<'_>) -> Option<Self> {
        match r.take::<u8>()? {
            0 => Some(None),
            1 => Some(Some(r.take()?)),
            _ => None,
        }
    }
}

/// `count: u32` then the items. The count is checked against the bytes left before anything
/// is reserved (every item type sent takes at least one byte).
impl<T: Wire> Wire for Vec<T> {
    fn put(&self, w: &mut Writer) {
        w.put(&(self.len() as u32));
        for v in self {
            w.put(v);
        }
    }
    fn take(r: &mut Reader<'_>) -> Option<Self> {
        let n = r.take::<u32>()? as usize;
        if n > r.remaining() {
            return None;
        }
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(r.take()?);
        }
        Some(v)
    }
}

/// `length: u32` then UTF-8 bytes (invalid UTF-8 is replaced, never refused: the strings
/// exchanged are host names and error messages).
impl Wire for String {
    fn put(&self, w: &mut Writer) {
        w.put(&(self.len() as u32)).raw(self.as_bytes());
    }
    fn take(r: &mut Reader<'_>) -> Option<Self> {
        let n = r.take::<u32>()? as usize;
        Some(String::from_utf8_lossy(r.raw(n)?).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_and_truncation_is_refused() {
        let msg = (
            7u64,
            [3u8; 16],
            Some(5usize),
            None::<u32>,
            vec![1u16, 2, 3],
            "ünïcode host".to_string(),
        );
        let mut w = Writer::default();
        w.put(&msg.0)
            .put(&msg.1)
            .put(&msg.2)
            .put(&msg.3)
            .put(&msg.4)
            .put(&msg.5)
            .put(&true);
        let bytes = w.finish();
        let mut r = Reader::new(&bytes);
        assert_eq!(r.take::<u64>(), Some(7));
        assert_eq!(r.take::<[u8; 16]>(), Some([3; 16]));
        assert_eq!(r.take::<Option<usize>>(), Some(Some(5)));
        assert_eq!(r.take::<Option<u32>>(), Some(None));
        assert_eq!(r.take::<Vec<u16>>(), Some(vec![1, 2, 3]));
        assert_eq!(r.take::<String>().as_deref(), Some("ünïcode host"));
        assert_eq!(r.take::<bool>(), Some(true));
        assert!(r.is_empty());
        // Every truncation of a list fails cleanly.
        let list = vec![9u64; 5].to_wire();
        for cut in 0..list.len() {
            assert_eq!(Vec::<u64>::from_wire(&list[..cut]), None, "cut at {cut}");
        }
        assert_eq!(Vec::<u64>::from_wire(&list), Some(vec![9; 5]));
        // Trailing bytes are malformed; a huge count does not allocate.
        assert_eq!(u32::from_wire(&[1, 0, 0, 0, 0]), None);
        assert_eq!(Vec::<u8>::from_wire(&[0xff, 0xff, 0xff, 0xff, 1]), None);
        assert_eq!(bool::from_wire(&[2]), None);
    }
}
