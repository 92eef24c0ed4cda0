//! Scratch buffers, reused so that large operations do not fault in fresh pages every time.
//!
//! Owns: the free lists. Must not know: what the buffers are for.

use crate::reduce::Reducible;

/// Scratch buffers for collectives, by element type, so that large transfers reuse memory
/// instead of faulting in fresh pages every time (receive buffers, 16-bit floats widened to
/// `f32`, reduce_scatter's working copy). Holds a few buffers per type, each as large as the
/// largest use it served: memory a large collective needed once stays reserved for the next.
#[derive(Default)]
pub(crate) struct Pool {
    free: std::sync::Mutex<
        std::collections::HashMap<std::any::TypeId, Vec<Box<dyn std::any::Any + Send>>>,
    >,
}

impl Pool {
    const PER_TYPE: usize = 4;

    /// An empty buffer, with capacity left over from earlier use when there is one.
    pub(crate) fn take<T: Reducible>(&self) -> Vec<T> {
        let mut v = self.pop();
        v.clear();
        v
    }

    /// A buffer of exactly `len` elements whose contents are whatever they were (zeros where it
    /// had to grow): for targets that are overwritten anyway, without paying to clear them.
    pub(crate) fn take_len<T: Reducible>(&self, len: usize) -> Vec<T> {
        let mut v = self.pop();
        v.resize(len, T::zeroed());
        v
    }

    /// A kept buffer of `T` as it was given back, or a new empty one.
    fn pop<T: Reducible>(&self) -> Vec<T> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        free.get_mut(&std::any::TypeId::of::<T>())
            .and_then(|v| v.pop())
            .and_then(|b| b.downcast::<Vec<T>>().ok())
            .map(|b| *b)
            .unwrap_or_default()
    }

    /// Returns a buffer for reuse.
    pub(crate) fn give<T: Reducible>(&self, buf: Vec<T>) {
        if buf.capacity() == 0 {
            return;
        }
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let list = free.entry(std::any::TypeId::of::<T>()).or_default();
        if list.len() < Self::PER_TYPE {
            list.push(Box::new(buf));
        }
    }
}
