//! Point-to-point over real processes and real sockets, one topic a module. Each rank re-runs
//! this binary with its test's full name (`module::test`), which every `run` call passes.

#[path = "../common/mod.rs"]
mod common;

mod delivery;
mod failures;
mod handles;
mod refusals;

use distcomm::ProcessGroup;

/// The next and previous rank around the group.
fn ring(g: &ProcessGroup) -> (usize, usize) {
    let n = g.size();
    ((g.rank() + 1) % n, (g.rank() + n - 1) % n)
}
