//! Warming up before timing: the suites run their op untimed for [`WARM_UP`] first.
//!
//! Owns: how long and how ranks agree to stop. Must not know: what the op is.

use std::time::{Duration, Instant};

use distcomm::Result;

/// How long every timed op runs untimed first. Ranks fresh from set-up (which waits asleep on
/// the store) run their first milliseconds of calls slowly: an 8 B ping-pong over shared memory
/// took 0.36-0.37 µs for its first 2,000 round trips and 0.19-0.20 µs from then on (six sizes
/// of 8 B in one run, six runs; 5 of 6 first sizes slow, no later one), and 8 B broadcast,
/// gather and scatter on two ranks 0.13-0.14 against 0.12. A sleep before the first call did
/// not help; 5,000 round trips (a few ms) did. Open MPI's benchmarks start right after
/// `MPI_Init`, whose own exchanges keep every rank busy until then.
pub const WARM_UP: Duration = Duration::from_millis(20);

/// Runs `batch` (untimed calls that every taking part rank makes alike) until the `lead` rank
/// has run batches for [`WARM_UP`]. After each batch `agree` takes the lead's wish to go on
/// (`false` from the others) and returns the lead's, as every rank sees it.
pub fn warm_up(
    lead: bool,
    mut batch: impl FnMut() -> Result<()>,
    mut agree: impl FnMut(bool) -> Result<bool>,
) -> Result<()> {
    let start = Instant::now();
    loop {
        batch()?;
        if !agree(lead && start.elapsed() < WARM_UP)? {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lead_batches_for_the_warm_up_and_the_others_follow_its_word() {
        let start = Instant::now();
        let mut batches = 0;
        warm_up(
            true,
            || {
                batches += 1;
                std::thread::sleep(Duration::from_millis(1));
                Ok(())
            },
            Ok,
        )
        .unwrap();
        assert!(start.elapsed() >= WARM_UP);
        assert!(batches >= 2, "{batches}");
        // A follower stops when told, whatever its clock says.
        let mut told = [true, true, false].into_iter();
        let mut batches = 0;
        warm_up(
            false,
            || {
                batches += 1;
                Ok(())
            },
            |_| Ok(told.next().unwrap()),
        )
        .unwrap();
        assert_eq!(batches, 3);
    }
}
