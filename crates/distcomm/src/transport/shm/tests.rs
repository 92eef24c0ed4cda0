//! Unit tests of the rings, the lane and segment lifecycle, in one process.

use super::*;

fn pair(cap: usize) -> ShmLink {
    // Tests run in parallel threads of one process: one name each.
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let k = NEXT.fetch_add(1, Ordering::Relaxed);
    let name = format!("{PREFIX}{}-test-{k}", std::process::id());
    let a = create(&name, cap).unwrap();
    let b = open(&name).unwrap();
    assert!(!std::path::Path::new(&format!("{SHM_DIR}/{name}")).exists());
    // A link whose rx is the same segment as its tx: a loop back to ourselves.
    ShmLink::new(a, b, 0, false)
}

#[test]
fn ring_wraps_and_stops_when_full() {
    let link = pair(4096);
    let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
    let mut got = Vec::new();
    let mut sent = 0;
    let mut buf = vec![0u8; 1000];
    while got.len() < data.len() {
        let (n, _) = link.write(&[IoSlice::new(&data[sent..])]).unwrap();
        assert!(n <= 4096);
        sent += n;
        let (m, _) = link.read(&mut buf).unwrap();
        got.extend_from_slice(&buf[..m]);
    }
    assert_eq!(got, data);
}

#[test]
fn sleeping_consumer_asks_for_a_doorbell() {
    let link = pair(4096);
    assert!(!link.prepare_sleep(false));
    let (_, ring) = link.write(&[IoSlice::new(b"x")]).unwrap();
    assert!(ring, "a sleeping consumer must be rung");
    let (_, ring) = link.write(&[IoSlice::new(b"y")]).unwrap();
    assert!(!ring, "one doorbell per sleep");
    assert!(link.prepare_sleep(false), "data is waiting: do not sleep");
}

#[test]
fn corrupt_indices_are_an_error() {
    let link = pair(4096);
    link.tx.atomic64(OFF_TAIL).store(1 << 40, Ordering::Relaxed);
    assert!(link.read(&mut [0u8; 16]).is_err());
    assert!(link.write(&[IoSlice::new(b"z")]).is_err());
}

fn head(k: u8) -> [u8; LANE_HEAD] {
    std::array::from_fn(|i| k.wrapping_add(i as u8))
}

fn payload(k: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| k.wrapping_mul(31).wrapping_add(i as u8))
        .collect()
}

/// Takes the next lane message whole: header, payload.
fn take(link: &ShmLink) -> Option<(LaneMsg, [u8; LANE_HEAD], Vec<u8>)> {
    take_answering(link, None)
}

/// Where in the pool lane message `m` (taken from `link`, nothing sent since) lay.
fn pool_offset(link: &ShmLink, m: LaneMsg) -> usize {
    link.rx.slot_offset(m.seq).load(Ordering::Relaxed) as usize
}

/// Takes the next lane message whole, answering it with `answer` (`Some(refused)`).
fn take_answering(
    link: &ShmLink,
    answer: Option<bool>,
) -> Option<(LaneMsg, [u8; LANE_HEAD], Vec<u8>)> {
    let mut h = [0u8; LANE_HEAD];
    let m = link.lane_peek(&mut h).unwrap()?;
    let mut data = vec![0u8; m.len as usize];
    link.lane_copy(m, &mut data);
    link.lane_release(m, answer);
    Some((m, h, data))
}

#[test]
fn lane_keeps_order_and_sizes() {
    let link = pair(4096);
    // Sizes around the slot's inline limit and the spread area's; sent and taken in waves that
    // wrap the slots and the pool (a message refused for want of room waits for the oldest to
    // be taken).
    let lens = [
        0,
        1,
        8,
        FIRST,
        FIRST + 1,
        64,
        SPREAD_MAX,
        SPREAD_MAX + 1,
        1000,
        LANE_MAX,
    ];
    let mut sent = std::collections::VecDeque::new();
    let take_oldest = |sent: &mut std::collections::VecDeque<(u64, u8, usize)>| {
        let (seq, tag, len) = sent.pop_front().unwrap();
        let (m, h, data) = take(&link).unwrap();
        assert_eq!((m.seq, m.len as usize), (seq, len));
        assert_eq!((h, data), (head(tag), payload(tag, len)));
    };
    for wave in 0..20u8 {
        for (k, &len) in lens.iter().enumerate() {
            let tag = wave.wrapping_mul(16).wrapping_add(k as u8);
            let seq = loop {
                match link
                    .lane_send(&head(tag), &payload(tag, len), None)
                    .unwrap()
                {
                    Some(sent) => break sent.seq,
                    None => take_oldest(&mut sent),
                }
            };
            sent.push_back((seq, tag, len));
        }
        while sent.len() > 2 {
            take_oldest(&mut sent);
        }
    }
    while let Some((seq, tag, len)) = sent.pop_front() {
        let (m, h, data) = take(&link).unwrap();
        assert_eq!((m.seq, h, data), (seq, head(tag), payload(tag, len)));
    }
    assert!(take(&link).is_none());
}

#[test]
fn sequence_numbers_wrap_past_their_48_bits() {
    let link = pair(4096);
    let start = SEQ_MASK - 3;
    link.tx_lane.set(start);
    link.tx_lane_head.set(start);
    link.tx
        .atomic64(OFF_LANE_HEAD)
        .store(start, Ordering::Relaxed);
    link.rx_lane.set(start);
    for k in 0..8u8 {
        link.lane_send(&head(k), &payload(k, 100), None)
            .unwrap()
            .unwrap();
        let (_, h, data) = take(&link).unwrap();
        assert_eq!((h, data), (head(k), payload(k, 100)));
    }
}

#[test]
fn a_peeked_message_is_not_taken() {
    let link = pair(4096);
    let seq = link
        .lane_send(&head(1), &payload(1, 100), None)
        .unwrap()
        .unwrap()
        .seq;
    let mut h = [0u8; LANE_HEAD];
    let m = link.lane_peek(&mut h).unwrap().unwrap();
    assert_eq!(link.lane_peek(&mut h).unwrap(), Some(m));
    assert_eq!(m.seq, seq);
    link.lane_release(m, None);
    assert_eq!(link.lane_peek(&mut h).unwrap(), None);
}

#[test]
fn lane_and_ring_never_overtake_each_other() {
    let link = pair(4096);
    let (n, _) = link.write(&[IoSlice::new(b"ring")]).unwrap();
    assert_eq!(n, 4);
    assert!(
        link.lane_send(&head(1), b"x", None).unwrap().is_none(),
        "unread ring bytes come first"
    );
    link.read(&mut [0u8; 4]).unwrap();
    assert!(link.lane_send(&head(1), b"x", None).unwrap().is_some());
    assert_eq!(
        link.write(&[IoSlice::new(b"x")]).unwrap().0,
        0,
        "an untaken lane message comes first"
    );
    let mut h = [0u8; LANE_HEAD];
    let m = link.lane_peek(&mut h).unwrap().unwrap();
    assert_eq!(
        link.write(&[IoSlice::new(b"x")]).unwrap().0,
        0,
        "not yet released"
    );
    link.lane_release(m, None);
    assert_eq!(link.write(&[IoSlice::new(b"x")]).unwrap().0, 1);
}

#[test]
fn answers_reach_the_producer() {
    let link = pair(4096);
    let watch = link.watch();
    let a = link
        .lane_send(&head(1), &payload(1, 300), None)
        .unwrap()
        .unwrap()
        .seq;
    let b = link.lane_send(&head(2), b"", None).unwrap().unwrap().seq;
    assert_eq!((watch.answered(a), link.answered(b)), (None, None));
    assert!(watch.incoming() && !watch.ring_incoming());
    let mut h = [0u8; LANE_HEAD];
    let m = link.lane_peek(&mut h).unwrap().unwrap();
    link.lane_release(m, Some(false));
    let m = link.lane_peek(&mut h).unwrap().unwrap();
    link.lane_release(m, None);
    assert!(!watch.incoming());
    link.lane_answer(b, true);
    assert_eq!(
        (watch.answered(a), link.answered(b)),
        (Some(true), Some(false))
    );
}

#[test]
fn sleeping_consumer_is_rung_for_a_lane_message() {
    let link = pair(4096);
    assert!(!link.prepare_sleep(false));
    let ring = link.lane_send(&head(1), b"x", None).unwrap().unwrap().ring;
    assert!(ring, "a sleeping consumer must be rung");
    assert!(
        link.prepare_sleep(false),
        "a lane message is waiting: do not sleep"
    );
}

#[test]
fn lane_holds_exactly_its_slots_of_small_messages() {
    let link = pair(4096);
    for round in 0..3u8 {
        // Full with LANE_SLOTS messages, then refused.
        for k in 0..LANE_SLOTS {
            assert!(
                link.lane_send(&head(round), &payload(k as u8, 8), None)
                    .unwrap()
                    .is_some(),
                "round {round}: message {k} refused with room"
            );
        }
        assert!(
            link.lane_send(&head(round), b"x", None).unwrap().is_none(),
            "full"
        );
        // One taken: exactly one more fits, in the slot just freed.
        let (_, h, data) = take(&link).unwrap();
        assert_eq!((h, data), (head(round), payload(0, 8)));
        link.lane_send(&head(round), &payload(LANE_SLOTS as u8, 8), None)
            .unwrap()
            .unwrap();
        assert!(
            link.lane_send(&head(round), b"x", None).unwrap().is_none(),
            "full again"
        );
        for k in 1..=LANE_SLOTS {
            let (_, h, data) = take(&link).unwrap();
            assert_eq!(
                (h, data),
                (head(round), payload(k as u8, 8)),
                "round {round}: {k}"
            );
        }
        assert!(take(&link).is_none());
    }
}

#[test]
fn long_payloads_fill_the_pool_then_wait_for_room() {
    let link = pair(4096);
    let long = |k: u64| payload(k as u8, LANE_MAX - k as usize % 7);
    // As many payloads of LANE_MAX bytes as the pool holds.
    let fit = (POOL / LANE_MAX) as u64;
    for round in 0..3u64 {
        for k in 0..fit {
            assert!(
                link.lane_send(&head(1), &long(k), None).unwrap().is_some(),
                "round {round}: long message {k} refused with room"
            );
        }
        assert!(link.lane_send(&head(1), &long(99), None).unwrap().is_none());
        // One taken: one more fits, where it lay; then the pool is full again, while a short
        // message still fits its slot.
        assert_eq!(take(&link).unwrap().2, long(0));
        let seq = link
            .lane_send(&head(1), &long(100), None)
            .unwrap()
            .unwrap()
            .seq;
        assert!(link.lane_send(&head(1), &long(99), None).unwrap().is_none());
        link.lane_send(&head(2), b"short", None).unwrap().unwrap();
        // Nothing was overwritten: everything comes out whole, in order.
        for k in 1..fit {
            assert_eq!(take(&link).unwrap().2, long(k), "round {round}: {k}");
        }
        let (m, _, data) = take(&link).unwrap();
        assert_eq!((m.seq, pool_offset(&link, m), data), (seq, 0, long(100)));
        assert_eq!(take(&link).unwrap().2, b"short");
        assert!(take(&link).is_none());
    }
}

#[test]
fn a_wrapped_pool_payload_stops_short_of_the_oldest() {
    let link = pair(4096);
    let fit = (POOL / LANE_MAX) as u8;
    for k in 0..fit {
        link.lane_send(&head(1), &payload(k, LANE_MAX), None)
            .unwrap()
            .unwrap();
    }
    // Two taken: 2 KiB free at the start, then the oldest untaken payload.
    take(&link).unwrap();
    take(&link).unwrap();
    let mid = SPREAD_MAX + 64;
    for k in [100, 101] {
        link.lane_send(&head(1), &payload(k, mid), None)
            .unwrap()
            .unwrap();
    }
    // 2 * 576 + 960 bytes would reach one line into it.
    assert!(link
        .lane_send(&head(1), &payload(102, LANE_MAX - 64), None)
        .unwrap()
        .is_none());
    for k in 2..fit {
        assert_eq!(take(&link).unwrap().2, payload(k, LANE_MAX), "{k}");
    }
    for k in [100, 101] {
        assert_eq!(take(&link).unwrap().2, payload(k, mid));
    }
    assert!(take(&link).is_none());
}

#[test]
fn a_ping_pong_reuses_the_start_of_the_pool() {
    // Each message answered (accepted or refused): the next one's payload starts over.
    let link = pair(4096);
    for k in 0..3 * LANE_SLOTS {
        let data = payload(k as u8, SPREAD_MAX + 1 + k as usize);
        link.lane_send(&head(1), &data, None).unwrap().unwrap();
        let (m, _, got) = take_answering(&link, Some(k % 3 == 0)).unwrap();
        assert_eq!((pool_offset(&link, m), got), (0, data), "message {k}");
    }
    // Unanswered (as scheduled messages are), payloads go one after another; the producer
    // starts over once it finds, having run out of room, that everything was taken.
    let mut at = Vec::new();
    for k in 0..2 * LANE_SLOTS {
        let data = payload(k as u8, LANE_MAX);
        link.lane_send(&head(1), &data, None).unwrap().unwrap();
        let (m, _, got) = take(&link).unwrap();
        assert_eq!(got, data);
        at.push(pool_offset(&link, m));
    }
    assert!(at.windows(2).all(|w| w[1] == w[0] + LANE_MAX || w[1] == 0));
    assert!(at.iter().filter(|&&a| a == 0).count() >= 2, "{at:?}");
}

#[test]
fn a_payload_never_reads_as_a_message() {
    // Payloads full of the words later messages are published with: they lie in the spread
    // area or the pool, never where the consumer looks for the next message.
    let link = pair(4096);
    for round in 0..3 * LANE_SLOTS {
        let len = if round % 2 == 0 { LANE_MAX } else { SPREAD_MAX };
        let words: Vec<u8> = (round + 2..round + 2 + len as u64 / 8)
            .flat_map(|w| w.to_le_bytes())
            .collect();
        link.lane_send(&head(1), &words, None).unwrap().unwrap();
        let (_, _, data) = take(&link).unwrap();
        assert_eq!(data, words);
        assert!(take(&link).is_none(), "round {round}: a phantom message");
    }
}

#[test]
fn corrupt_lane_is_an_error() {
    let link = pair(4096);
    link.lane_send(&head(1), b"x", None).unwrap().unwrap();
    link.tx
        .atomic64(OFF_LANE_HEAD)
        .store(1 << 40, Ordering::Relaxed);
    assert!(link.write(&[IoSlice::new(b"z")]).is_err(), "a bad count");
    let link = pair(4096);
    link.tx
        .slot_seq(1)
        .store(1 | 5000 << LEN_SHIFT, Ordering::Relaxed);
    assert!(
        link.lane_peek(&mut [0u8; LANE_HEAD]).is_err(),
        "an oversized message"
    );
    // A payload said to lie past the end of the payload area, or off a line.
    for at in [POOL - 64, 100] {
        let link = pair(4096);
        link.tx.slot_offset(1).store(at as u32, Ordering::Relaxed);
        link.tx
            .slot_seq(1)
            .store(1 | (LANE_MAX as u64) << LEN_SHIFT, Ordering::Relaxed);
        assert!(
            link.lane_peek(&mut [0u8; LANE_HEAD]).is_err(),
            "offset {at}"
        );
    }
}

#[test]
fn cma_reads_our_own_memory() {
    let src: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
    let mut dst = vec![0u8; src.len()];
    cma_read(std::process::id() as i32, src.as_ptr() as u64, &mut dst).unwrap();
    assert_eq!(src, dst);
}

#[test]
fn cma_writes_our_own_memory() {
    let src: Vec<u8> = (0..100_000u32).map(|i| (i * 3) as u8).collect();
    let mut dst = vec![0u8; src.len()];
    cma_write(std::process::id() as i32, dst.as_mut_ptr() as u64, &src).unwrap();
    assert_eq!(src, dst);
}

/// Reads and writes at every skew of the two buffers within a page, by the kernel's copy
/// alone, through the bounce buffer (in pieces) and as [`cma_read`]/[`cma_write`] choose
/// between the two, of lengths across the pieces' bounds, move exactly the bytes asked and
/// nothing around them.
#[test]
fn cma_copies_at_every_skew_exactly() {
    type Read = fn(i32, u64, &mut [u8]) -> io::Result<()>;
    type Write = fn(i32, u64, &[u8]) -> io::Result<()>;
    let ways: [(&str, Read, Write); 3] = [
        ("chosen", cma_read, cma_write),
        ("bounced", cma::read_bounced, cma::write_bounced),
        ("straight", cma::read_raw, cma::write_raw),
    ];
    let pid = std::process::id() as i32;
    let src: Vec<u8> = (0..300_000u32).map(|i| (i * 13 + 5) as u8).collect();
    let from = src[5..].as_ptr() as usize;
    // Where in `buf` a range lies `skew` bytes past `src[5..]` modulo a page (from 1 on).
    let place = |buf: &[u8], skew: usize| {
        let want = (from + skew) % 4096;
        1 + (want + 4096 - (buf[1..].as_ptr() as usize % 4096)) % 4096
    };
    for (way, read, write) in ways {
        for skew in [0usize, 1, 8, 16, 31, 32, 33, 4095] {
            for len in [0usize, 1, 100, 4096, 65_536, 65_537, 200_003] {
                let what = format!("{way} skew {skew} len {len}");
                let mut dst = vec![0xAAu8; len + 4096 + 2];
                let at = place(&dst, skew);
                read(pid, from as u64, &mut dst[at..at + len]).unwrap();
                assert_eq!(&dst[at..at + len], &src[5..5 + len], "read {what}");
                assert!(dst[..at].iter().chain(&dst[at + len..]).all(|&b| b == 0xAA));
                let mut back = vec![0x55u8; len + 4096 + 2];
                let at = place(&back, skew);
                let to = back[at..].as_mut_ptr() as u64;
                write(pid, to, &src[5..5 + len]).unwrap();
                assert_eq!(&back[at..at + len], &src[5..5 + len], "write {what}");
                assert!(back[..at]
                    .iter()
                    .chain(&back[at + len..])
                    .all(|&b| b == 0x55));
            }
        }
    }
}

/// The skew probe times both reads (a cross-memory copy into this process works wherever
/// the tests run, whatever Yama says: it is the process's own memory).
#[test]
fn the_skew_probe_times_both_reads() {
    for skew in [8, 24] {
        let (straight, skewed) = cma::time_skews(skew).expect("reads into our own memory");
        assert!(straight > std::time::Duration::ZERO && skewed > std::time::Duration::ZERO);
    }
}

#[test]
fn foreign_segments_are_refused() {
    let name = format!("{PREFIX}{}-foreign", std::process::id());
    std::fs::write(format!("{SHM_DIR}/{name}"), vec![0u8; 8192]).unwrap();
    assert!(open(&name).is_err());
}

/// A point-to-point key for the pre-acceptance tests.
fn key(tag: u32, dtype: u8) -> LaneKey {
    LaneKey {
        key: 7 | u64::from(tag) << 32,
        dtype,
    }
}

/// The owners of posts in these tests.
const A: u64 = 1;
const B: u64 = 2;

#[test]
fn a_posted_receive_takes_the_message_it_accepts() {
    let link = pair(4096);
    assert!(link.lane_post(key(3, 7), 8, A));
    // A posted receive is not a message.
    assert!(link.lane_peek(&mut [0u8; LANE_HEAD]).unwrap().is_none());
    assert!(!link.watch().incoming());
    assert_eq!(link.lane_held(), None);
    let sent = link
        .lane_send(&head(1), &payload(1, 8), Some(key(3, 7)))
        .unwrap()
        .unwrap();
    assert!(sent.pre, "accepted by the posted receive");
    assert_eq!(link.lane_held(), Some(A));
    // Ours to take: withdrawing fails, and another receive's withdrawal does nothing.
    assert!(link.lane_withdraw(B, false));
    assert!(!link.lane_withdraw(A, false));
    let (m, h, data) = take(&link).unwrap();
    assert!(m.pre);
    assert_eq!((h, data), (head(1), payload(1, 8)));
    // Nothing posted now, and no answer was written.
    assert_eq!(link.lane_held(), None);
    assert!(link.lane_withdraw(A, false));
    assert_eq!(link.answered(sent.seq), None);
}

#[test]
fn a_posted_receive_never_accepts_what_it_would_refuse() {
    // Another tag, another type, too large: published as usual, to be answered.
    for (offer, len) in [(key(4, 7), 8), (key(3, 5), 8), (key(3, 7), 9)] {
        let link = pair(4096);
        assert!(link.lane_post(key(3, 7), 8, A));
        let sent = link
            .lane_send(&head(1), &payload(1, len), Some(offer))
            .unwrap()
            .unwrap();
        assert!(!sent.pre, "{offer:?}, {len} bytes");
        assert_eq!(link.lane_held(), None);
        // The message ended the post.
        assert!(link.lane_withdraw(A, false));
        let (m, _, data) = take(&link).unwrap();
        assert!(!m.pre);
        assert_eq!(data, payload(1, len));
    }
    // A message without a key (a scheduled one) is never pre-accepted either.
    let link = pair(4096);
    assert!(link.lane_post(key(3, 7), 8, A));
    let sent = link.lane_send(&head(1), b"x", None).unwrap().unwrap();
    assert!(!sent.pre);
    assert!(link.lane_withdraw(A, false));
    assert!(!take(&link).unwrap().0.pre);
}

#[test]
fn a_raw_receive_accepts_any_type() {
    let link = pair(4096);
    assert!(link.lane_post(key(3, 0), LANE_MAX, A));
    let sent = link
        .lane_send(&head(1), &payload(1, LANE_MAX), Some(key(3, 5)))
        .unwrap()
        .unwrap();
    assert!(sent.pre);
    assert_eq!(take(&link).unwrap().2, payload(1, LANE_MAX));
}

#[test]
fn a_withdrawn_receive_accepts_nothing() {
    let link = pair(4096);
    assert!(link.lane_post(key(3, 7), 8, A));
    assert!(link.lane_withdraw(A, false));
    let sent = link
        .lane_send(&head(1), &payload(1, 8), Some(key(3, 7)))
        .unwrap()
        .unwrap();
    assert!(!sent.pre);
    let (m, h, _) = take(&link).unwrap();
    assert_eq!((m.seq, m.pre, h), (sent.seq, false, head(1)));
    // Posted again (for the next message) after a withdrawal: another word.
    assert!(link.lane_post(key(3, 7), 8, A));
    let first = link.rx_post.get().unwrap().word;
    assert!(link.lane_withdraw(A, false));
    assert!(link.lane_post(key(3, 7), 8, A));
    assert_ne!(link.rx_post.get().unwrap().word, first);
}

#[test]
fn one_receive_posts_at_a_time() {
    let link = pair(4096);
    assert!(link.lane_post(key(3, 7), 8, A));
    assert!(link.lane_post(key(3, 7), 8, A), "posted already");
    assert!(!link.lane_post(key(4, 7), 8, B), "A's post is there");
    // B's message is not pre-accepted by A's post, and ends it.
    let sent = link
        .lane_send(&head(2), b"b", Some(key(4, 7)))
        .unwrap()
        .unwrap();
    assert!(!sent.pre);
    assert!(link.lane_withdraw(A, false));
    take(&link).unwrap();
    assert!(link.lane_post(key(4, 7), 8, B));
}

#[test]
fn a_receive_is_not_posted_over_a_message() {
    let link = pair(4096);
    link.lane_send(&head(1), b"x", Some(key(3, 7)))
        .unwrap()
        .unwrap();
    assert!(!link.lane_post(key(3, 7), 8, A));
    assert!(link.lane_withdraw(A, false));
    assert!(!take(&link).unwrap().0.pre);
}

#[test]
fn a_message_after_ring_bytes_is_not_pre_accepted() {
    // The receive posted may not know what came by the ring since the last lane message.
    let link = pair(4096);
    assert!(link.lane_post(key(3, 7), 8, A));
    link.write(&[IoSlice::new(b"frame")]).unwrap();
    link.read(&mut [0u8; 16]).unwrap();
    let sent = link
        .lane_send(&head(1), b"x", Some(key(3, 7)))
        .unwrap()
        .unwrap();
    assert!(!sent.pre);
    assert!(link.lane_withdraw(A, false));
    take(&link).unwrap();
    // The next one may be again.
    assert!(link.lane_post(key(3, 7), 8, A));
    let sent = link
        .lane_send(&head(1), b"y", Some(key(3, 7)))
        .unwrap()
        .unwrap();
    assert!(sent.pre);
}

#[test]
fn a_disowned_message_is_taken_like_any_other() {
    let link = pair(4096);
    assert!(link.lane_post(key(3, 7), 8, A));
    link.lane_send(&head(1), b"x", Some(key(3, 7)))
        .unwrap()
        .unwrap();
    assert!(!link.lane_withdraw(A, false));
    assert!(link.lane_withdraw(A, true));
    assert_eq!(link.lane_held(), None);
    let (m, _, data) = take(&link).unwrap();
    // Still a message whose sender waits for no answer.
    assert_eq!((m.pre, data), (true, b"x".to_vec()));
}

#[test]
fn a_post_tells_the_producer_everything_was_taken() {
    // A ping-pong of pool-sized messages whose answers never come (pre-accepted) still
    // keeps to the pool's start: the post says the consumer took every earlier message.
    let link = pair(4096);
    let data = payload(9, LANE_MAX);
    for _ in 0..3 {
        assert!(link.lane_post(key(3, 7), LANE_MAX, A));
        let sent = link
            .lane_send(&head(1), &data, Some(key(3, 7)))
            .unwrap()
            .unwrap();
        assert!(sent.pre);
        let (m, _, got) = take(&link).unwrap();
        assert_eq!((pool_offset(&link, m), got), (0, data.clone()));
    }
}
