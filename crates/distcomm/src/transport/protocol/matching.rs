//! Message matching (MPI semantics, contract 4 of the design): receives are posted in order,
//! messages arrive in order per source; a message goes to the first posted receive that can
//! take it, a receive to the first arrived (unexpected) message it can take. So messages
//! between one (source, context, tag) are delivered in posting order (non-overtaking), and a
//! receive from any source competes in posting order with receives that name their source.
//!
//! Owns the two queues; knows neither buffers nor frames: receives and messages only say who
//! and what they are ([`Receive`], [`Message`]).

use std::collections::VecDeque;

/// A matching key: (context, tag).
pub(crate) type Key = (u32, u32);

/// A posted receive as matching sees it.
pub(crate) trait Receive {
    /// The source it wants (`None`: any).
    fn source(&self) -> Option<usize>;
    fn key(&self) -> Key;
}

/// An arrived message as matching sees it.
pub(crate) trait Message {
    fn source(&self) -> usize;
    fn key(&self) -> Key;
}

/// Whether a receive wanting (`want`, `key`) takes a message from `src` with `mkey`.
#[inline]
pub(crate) fn takes(want: Option<usize>, key: Key, src: usize, mkey: Key) -> bool {
    key == mkey && want.is_none_or(|s| s == src)
}

/// The posted and unexpected queues of one engine. Unexpected messages queue per source, each
/// numbered in arrival order: a receive that names its source (the common case) looks only at
/// that source's messages, however many others wait (a gather's root that fell behind has
/// thousands queued from every peer: one queue made each of its receives scan and shift past
/// the other peers' messages, half of the root's time over TCP at world 4).
pub(crate) struct Matcher<R, M> {
    posted: VecDeque<R>,
    unexpected: Vec<VecDeque<(u64, M)>>,
    arrivals: u64,
}

impl<R, M> Default for Matcher<R, M> {
    fn default() -> Self {
        Matcher {
            posted: VecDeque::new(),
            unexpected: Vec::new(),
            arrivals: 0,
        }
    }
}

impl<R: Receive, M: Message> Matcher<R, M> {
    /// A message from `src` with `key` arrived: the first posted receive that takes it, taken
    /// out of the queue; `None` if none does (the caller queues the message as unexpected).
    #[inline]
    pub(crate) fn take_posted(&mut self, src: usize, key: Key) -> Option<R> {
        let i = self
            .posted
            .iter()
            .position(|r| takes(r.source(), r.key(), src, key))?;
        self.posted.remove(i)
    }

    /// Queues a message nobody was waiting for.
    #[inline]
    pub(crate) fn push_unexpected(&mut self, m: M) {
        let src = m.source();
        if self.unexpected.len() <= src {
            self.unexpected.resize_with(src + 1, VecDeque::new);
        }
        self.unexpected[src].push_back((self.arrivals, m));
        self.arrivals += 1;
    }

    /// A receive (`src`, `key`) is being posted: the first unexpected message it takes, taken
    /// out of the queue; `None` if none (the caller queues the receive with [`Self::push_posted`]).
    #[inline]
    pub(crate) fn take_unexpected(&mut self, src: Option<usize>, key: Key) -> Option<M> {
        let first = |q: &VecDeque<(u64, M)>| q.iter().position(|(_, m)| m.key() == key);
        let (q, i) = match src {
            Some(src) => {
                let q = self.unexpected.get_mut(src)?;
                let i = first(q)?;
                (q, i)
            }
            // Any source: the earliest arrival among each source's first match.
            None => {
                let (s, i) = self
                    .unexpected
                    .iter()
                    .enumerate()
                    .filter_map(|(s, q)| first(q).map(|i| (s, i)))
                    .min_by_key(|&(s, i)| self.unexpected[s][i].0)?;
                (&mut self.unexpected[s], i)
            }
        };
        q.remove(i).map(|(_, m)| m)
    }

    /// The first message from `src` with `key` that waits unexpected, taken out of the queue
    /// only if `pred` holds for it (what a receive posted now would take, see
    /// [`Self::take_unexpected`]).
    #[inline]
    pub(crate) fn take_unexpected_if(
        &mut self,
        src: usize,
        key: Key,
        pred: impl FnOnce(&M) -> bool,
    ) -> Option<M> {
        let q = self.unexpected.get_mut(src)?;
        let i = q.iter().position(|(_, m)| m.key() == key)?;
        if !pred(&q[i].1) {
            return None;
        }
        q.remove(i).map(|(_, m)| m)
    }

    /// Queues a receive behind every one posted before it.
    #[inline]
    pub(crate) fn push_posted(&mut self, r: R) {
        self.posted.push_back(r);
    }

    /// Whether a posted receive could take a message from `src` with `key` (a message taken
    /// past the queues would then overtake it).
    pub(crate) fn posted_could_take(&self, src: usize, key: Key) -> bool {
        self.posted
            .iter()
            .any(|r| takes(r.source(), r.key(), src, key))
    }

    /// The first posted receive for which `pred` holds, its position, and whether a message
    /// from its source with its key would go to it (it names its source, and no receive
    /// posted before it could take that message).
    pub(crate) fn find_posted(
        &self,
        mut pred: impl FnMut(&R) -> bool,
    ) -> Option<(usize, &R, bool)> {
        let i = self.posted.iter().position(&mut pred)?;
        let r = &self.posted[i];
        let first = r.source().is_some_and(|src| {
            !self
                .posted
                .iter()
                .take(i)
                .any(|o| takes(o.source(), o.key(), src, r.key()))
        });
        Some((i, r, first))
    }

    /// The posted receive at position `i`.
    pub(crate) fn posted_at(&self, i: usize) -> Option<&R> {
        self.posted.get(i)
    }

    /// Takes out the posted receive at position `i` (from [`Self::find_posted`]).
    pub(crate) fn remove_posted(&mut self, i: usize) -> Option<R> {
        self.posted.remove(i)
    }

    /// Whether a message from `src` with `key` waits unexpected.
    pub(crate) fn unexpected_from(&self, src: usize, key: Key) -> bool {
        self.unexpected
            .get(src)
            .is_some_and(|q| q.iter().any(|(_, m)| m.key() == key))
    }

    /// Takes out every posted receive for which `pred` holds, in posting order.
    pub(crate) fn withdraw_posted(&mut self, mut pred: impl FnMut(&R) -> bool) -> VecDeque<R> {
        let (hit, kept): (VecDeque<R>, VecDeque<R>) = self.posted.drain(..).partition(|r| pred(r));
        self.posted = kept;
        hit
    }

    /// Takes out every unexpected message for which `pred` holds, in arrival order.
    pub(crate) fn withdraw_unexpected(&mut self, mut pred: impl FnMut(&M) -> bool) -> VecDeque<M> {
        let mut hit = Vec::new();
        for q in &mut self.unexpected {
            let (taken, kept): (VecDeque<_>, VecDeque<_>) = q.drain(..).partition(|(_, m)| pred(m));
            *q = kept;
            hit.extend(taken);
        }
        hit.sort_by_key(|&(arrival, _)| arrival);
        hit.into_iter().map(|(_, m)| m).collect()
    }

    /// Takes out every posted receive.
    pub(crate) fn drain_posted(&mut self) -> std::collections::vec_deque::Drain<'_, R> {
        self.posted.drain(..)
    }

    /// The posted receives, in posting order.
    #[cfg(test)]
    pub(crate) fn posted(&self) -> impl Iterator<Item = &R> {
        self.posted.iter()
    }

    /// The unexpected messages, in arrival order.
    #[cfg(test)]
    pub(crate) fn unexpected(&self) -> impl Iterator<Item = &M> {
        let mut all: Vec<&(u64, M)> = self.unexpected.iter().flatten().collect();
        all.sort_by_key(|(arrival, _)| *arrival);
        all.into_iter().map(|(_, m)| m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// A receive: its posting number and what it wants.
    #[derive(Debug, Clone, Copy)]
    struct R {
        id: usize,
        src: Option<usize>,
        key: Key,
    }
    impl Receive for R {
        fn source(&self) -> Option<usize> {
            self.src
        }
        fn key(&self) -> Key {
            self.key
        }
    }
    /// A message: who sent it, its key, and its number in its sender's stream for that key.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct M {
        src: usize,
        key: Key,
        seq: usize,
    }
    impl Message for M {
        fn source(&self) -> usize {
            self.src
        }
        fn key(&self) -> Key {
            self.key
        }
    }

    /// Drives a matcher the way the engine does, recording who got what.
    #[derive(Default)]
    struct Sim {
        m: Matcher<R, M>,
        got: Vec<(R, M)>,
        next_seq: HashMap<(usize, Key), usize>,
        next_id: usize,
    }
    impl Sim {
        fn post(&mut self, src: Option<usize>, key: Key) {
            let r = R {
                id: self.next_id,
                src,
                key,
            };
            self.next_id += 1;
            match self.m.take_unexpected(src, key) {
                Some(msg) => self.got.push((r, msg)),
                None => self.m.push_posted(r),
            }
        }
        fn arrive(&mut self, src: usize, key: Key) {
            let n = self.next_seq.entry((src, key)).or_default();
            let msg = M { src, key, seq: *n };
            *n += 1;
            match self.m.take_posted(src, key) {
                Some(r) => self.got.push((r, msg)),
                None => self.m.push_unexpected(msg),
            }
        }
    }

    #[test]
    fn message_waits_for_its_receive_and_receive_for_its_message() {
        let mut s = Sim::default();
        s.arrive(1, (0, 5));
        s.post(Some(1), (0, 6));
        assert!(s.got.is_empty());
        s.post(Some(1), (0, 5));
        s.arrive(1, (0, 6));
        assert_eq!(s.got.len(), 2);
        assert!(s.got.iter().all(|(r, m)| r.key == m.key));
        assert_eq!(s.m.posted().count() + s.m.unexpected().count(), 0);
    }

    #[test]
    fn context_separates_equal_tags() {
        let mut s = Sim::default();
        s.post(Some(0), (1, 7));
        s.arrive(0, (2, 7));
        assert!(s.got.is_empty());
        s.arrive(0, (1, 7));
        assert_eq!(s.got[0].1.key, (1, 7));
    }

    #[test]
    fn any_source_takes_the_first_arrival_and_reports_it() {
        let mut s = Sim::default();
        s.post(None, (0, 1));
        s.post(Some(2), (0, 1));
        s.arrive(2, (0, 1));
        s.arrive(3, (0, 1));
        // The any-source receive was posted first: it gets rank 2's message, and rank 3's then
        // waits (the second receive wants rank 2 only).
        assert_eq!(s.got.len(), 1);
        assert_eq!((s.got[0].0.id, s.got[0].1.src), (0, 2));
        assert_eq!(s.m.unexpected().count(), 1);
        s.arrive(2, (0, 1));
        assert_eq!((s.got[1].0.id, s.got[1].1.src, s.got[1].1.seq), (1, 2, 1));
    }

    #[test]
    fn any_source_takes_unexpected_messages_in_arrival_order() {
        let mut s = Sim::default();
        s.arrive(3, (0, 1));
        s.arrive(1, (0, 1));
        s.post(None, (0, 1));
        s.post(None, (0, 1));
        let srcs: Vec<usize> = s.got.iter().map(|(_, m)| m.src).collect();
        assert_eq!(srcs, [3, 1]);
    }

    #[test]
    fn withdrawing_keeps_the_order_of_the_rest() {
        let mut s = Sim::default();
        for src in [Some(1), None, Some(2), Some(1)] {
            s.post(src, (0, 0));
        }
        let lost = s.m.withdraw_posted(|r| r.src == Some(1));
        assert_eq!(lost.iter().map(|r| r.id).collect::<Vec<_>>(), [0, 3]);
        assert_eq!(s.m.posted().map(|r| r.id).collect::<Vec<_>>(), [1, 2]);
        assert!(
            s.m.posted_could_take(1, (0, 0)),
            "the any-source receive still takes rank 1"
        );
        assert!(!s.m.posted_could_take(1, (0, 9)));
        s.arrive(4, (0, 3));
        assert!(s.m.unexpected_from(4, (0, 3)));
        assert!(!s.m.unexpected_from(4, (0, 0)));
        assert_eq!(s.m.withdraw_unexpected(|m| m.src == 4).len(), 1);
        assert!(!s.m.unexpected_from(4, (0, 3)));
    }

    #[derive(Debug, Clone)]
    enum Ev {
        /// Post a receive from this source (`None`: any) with this key.
        Post(Option<usize>, Key),
        /// A message from this source with this key arrives.
        Arrive(usize, Key),
    }

    fn events() -> impl Strategy<Value = Vec<Ev>> {
        let key = (0u32..2, 0u32..3);
        let ev = prop_oneof![
            (prop::option::weighted(0.7, 0usize..3), key.clone()).prop_map(|(s, k)| Ev::Post(s, k)),
            (0usize..3, key).prop_map(|(s, k)| Ev::Arrive(s, k)),
        ];
        prop::collection::vec(ev, 0..80)
    }

    proptest! {
        /// Whatever the interleaving of posts and arrivals: every pairing is one the receive
        /// accepts; no message or receive is used twice, and none is left waiting while a
        /// partner for it waits too; and within one (source, key) stream, receives posted
        /// earlier get earlier messages (non-overtaking).
        #[test]
        fn non_overtaking_under_any_interleaving(evs in events()) {
            let mut s = Sim::default();
            for e in &evs {
                match *e {
                    Ev::Post(src, k) => s.post(src, k),
                    Ev::Arrive(src, k) => s.arrive(src, k),
                }
            }
            for (r, m) in &s.got {
                prop_assert!(takes(r.src, r.key, m.src, m.key));
            }
            let mut ids: Vec<usize> = s.got.iter().map(|(r, _)| r.id).collect();
            ids.sort_unstable();
            ids.dedup();
            prop_assert_eq!(ids.len(), s.got.len());
            let mut msgs: Vec<(usize, Key, usize)> =
                s.got.iter().map(|(_, m)| (m.src, m.key, m.seq)).collect();
            msgs.sort_unstable();
            msgs.dedup();
            prop_assert_eq!(msgs.len(), s.got.len());
            for r in s.m.posted() {
                for m in s.m.unexpected() {
                    prop_assert!(!takes(r.src, r.key, m.src, m.key), "{:?} and {:?} both wait", r, m);
                }
            }
            // Per stream: in the order the receives were posted, sequence numbers increase.
            let mut by_stream: HashMap<(usize, Key), Vec<(usize, usize)>> = HashMap::new();
            for (r, m) in &s.got {
                by_stream.entry((m.src, m.key)).or_default().push((r.id, m.seq));
            }
            for (stream, mut v) in by_stream {
                v.sort_unstable();
                prop_assert!(v.windows(2).all(|w| w[0].1 < w[1].1), "stream {:?}: {:?}", stream, v);
                // Nothing of a stream is skipped: a later message matched means every earlier
                // one was matched too or still waits.
                let max = v.iter().map(|x| x.1).max().unwrap_or(0);
                let waiting = s.m.unexpected().filter(|m| (m.src, m.key) == stream).count();
                prop_assert!(v.len() + waiting > max);
            }
        }

        /// A source's loss withdraws the receives that name it, never an any-source receive
        /// nor another source's, and what stays keeps matching in order.
        #[test]
        fn peer_loss_withdraws_only_its_receives(evs in events(), lost in 0usize..3) {
            let mut s = Sim::default();
            for e in &evs {
                if let Ev::Post(src, k) = *e { s.post(src, k) }
            }
            let before: Vec<usize> = s.m.posted().map(|r| r.id).collect();
            let gone = s.m.withdraw_posted(|r| r.src == Some(lost));
            prop_assert!(gone.iter().all(|r| r.src == Some(lost)));
            let kept: Vec<usize> = s.m.posted().map(|r| r.id).collect();
            prop_assert!(kept.iter().all(|id| !gone.iter().any(|g| g.id == *id)));
            prop_assert_eq!(kept.len() + gone.len(), before.len());
            prop_assert!(kept.windows(2).all(|w| w[0] < w[1]));
        }
    }
}
