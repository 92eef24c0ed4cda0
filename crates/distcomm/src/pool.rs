//! Scratch buffers, reused so that large operations do not fault in fresh pages every time.
//!
//! Owns: the free lists. Must not know: what the buffers are for.

use crate::reduce::Reducible;

/// Scratch buffers, by element type, so that large transfers reuse memory instead of faulting
/// in fresh pages every time (collectives' receive buffers, 16-bit floats widened to `f32`,
/// reduce_scatter's working copy; the engine's buffers of unexpected payloads). Holds a few
/// buffers per type, each as large as the largest use it served: memory a large operation
/// needed once stays reserved for the next.
pub(crate) struct Pool {
    /// Buffers kept per element type.
    keep: usize,
    /// Per element type, its free list (a `Vec<Vec<T>>`). Looked up by a scan: a process uses
    /// a few element types, and neither hashing nor boxing each buffer belongs on the path of
    /// every small message.
    free: std::sync::Mutex<Vec<(std::any::TypeId, Box<dyn std::any::Any + Send>)>>,
}

impl Default for Pool {
    fn default() -> Pool {
        Pool::keeping(Pool::PER_TYPE)
    }
}

impl Pool {
    /// Buffers kept per element type by default.
    const PER_TYPE: usize = 4;

    /// A pool that keeps up to `keep` buffers per element type.
    pub(crate) fn keeping(keep: usize) -> Pool {
        Pool {
            keep,
            free: Default::default(),
        }
    }

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

    /// A buffer holding a copy of `src`, made with [`crate::copy::copy`] when the buffer is
    /// long enough already: `extend_from_slice` goes to glibc's `memcpy`, whose `rep movsb` is
    /// slow where the two buffers lie badly in their pages (see `crate::copy`; 11 % of a world
    /// 2 broadcast of 64 KiB over TCP in a slow run went there).
    pub(crate) fn copy_of<T: Reducible>(&self, src: &[T]) -> Vec<T> {
        let mut v: Vec<T> = self.pop();
        if v.len() >= src.len() {
            v.truncate(src.len());
            crate::copy::copy(&mut v, src);
        } else {
            // Too short: zeroing it before the copy would cost a pass over fresh memory.
            v.clear();
            v.extend_from_slice(src);
        }
        v
    }

    /// A kept buffer of `T` as it was given back, or a new empty one.
    fn pop<T: Reducible>(&self) -> Vec<T> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        Self::list::<T>(&mut free)
            .and_then(|l| l.pop())
            .unwrap_or_default()
    }

    /// Returns a buffer for reuse.
    pub(crate) fn give<T: Reducible>(&self, buf: Vec<T>) {
        if buf.capacity() == 0 {
            return;
        }
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        match Self::list::<T>(&mut free) {
            Some(list) if list.len() < self.keep => list.push(buf),
            Some(_) => {}
            None => {
                let mut list: Vec<Vec<T>> = Vec::with_capacity(self.keep);
                list.push(buf);
                free.push((std::any::TypeId::of::<T>(), Box::new(list)));
            }
        }
    }

    /// The free list of `T`, if it has one yet.
    fn list<T: Reducible>(
        free: &mut [(std::any::TypeId, Box<dyn std::any::Any + Send>)],
    ) -> Option<&mut Vec<Vec<T>>> {
        let id = std::any::TypeId::of::<T>();
        free.iter_mut()
            .find(|(t, _)| *t == id)
            .and_then(|(_, l)| l.downcast_mut::<Vec<Vec<T>>>())
    }
}

#[cfg(test)]
mod tests {
    use super::Pool;

    #[test]
    fn a_buffer_given_back_is_taken_again_by_its_own_type_only() {
        let pool = Pool::default();
        let mut a: Vec<f32> = pool.take_len(1000);
        a[999] = 7.0;
        let ptr = a.as_ptr();
        pool.give(a);
        // Another element type does not get it.
        let b: Vec<u8> = pool.take();
        assert_eq!(b.capacity(), 0);
        let again: Vec<f32> = pool.take();
        assert_eq!(again.as_ptr(), ptr);
        assert!(again.is_empty() && again.capacity() >= 1000);
    }

    #[test]
    fn it_keeps_a_few_buffers_per_type_and_drops_the_rest() {
        let pool = Pool::default();
        for _ in 0..Pool::PER_TYPE + 3 {
            pool.give(vec![1i32; 16]);
        }
        let kept = (0..Pool::PER_TYPE + 3)
            .map(|_| pool.take::<i32>())
            .filter(|v| v.capacity() > 0)
            .count();
        assert_eq!(kept, Pool::PER_TYPE);
    }
}
