//! Scratch memory of a group, reused from call to call: a collective on a list of tensors
//! that are not one block of memory goes through a contiguous buffer, and a fresh 64 MiB one
//! would fault in its pages on every call (slower than the transfer itself here).

use std::sync::Mutex;

/// Buffers kept for reuse (8-byte words, so that any element type can view them).
#[derive(Default)]
pub struct Scratch {
    free: Mutex<Vec<Vec<u64>>>,
}

/// Buffers a group keeps between calls (a call needs at most two at once).
const KEEP: usize = 2;

impl Scratch {
    /// A buffer of `len` bytes with unspecified (initialised) contents.
    pub fn get(&self, len: usize) -> Buf<'_> {
        let mut words = self
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or_default();
        let n = len.div_ceil(8);
        if words.len() < n {
            words.resize(n, 0);
        }
        Buf {
            pool: self,
            words,
            len,
        }
    }
}

/// A buffer of a [`Scratch`], handed back to it when dropped.
pub struct Buf<'a> {
    pool: &'a Scratch,
    words: Vec<u64>,
    len: usize,
}

impl Buf<'_> {
    pub fn bytes(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..self.len]
    }

    /// The buffer as elements of `T` (its length must be a whole number of them).
    pub fn typed<T: bytemuck::Pod>(&mut self) -> &mut [T] {
        let len = self.len;
        let bytes = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..len];
        // 8-byte aligned, and callers pass lengths that are whole elements: cannot fail for
        // the element types of torch (at most 8 bytes, power-of-two sizes).
        bytemuck::try_cast_slice_mut(bytes).unwrap_or(&mut [])
    }
}

impl Drop for Buf<'_> {
    fn drop(&mut self) {
        let mut free = self.pool.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < KEEP {
            free.push(std::mem::take(&mut self.words));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_and_sized() {
        let s = Scratch::default();
        let p = {
            let mut a = s.get(1000);
            assert_eq!(a.bytes().len(), 1000);
            assert_eq!(a.typed::<f32>().len(), 250);
            a.bytes()[999] = 7;
            a.words.as_ptr()
        };
        let mut b = s.get(800);
        assert_eq!(b.words.as_ptr(), p, "the buffer came back for reuse");
        assert_eq!(b.typed::<u16>().len(), 400);
        let mut c = s.get(10);
        assert_eq!(c.bytes().len(), 10);
        assert_ne!(c.words.as_ptr(), p);
    }
}
