//! The vocabulary of collective calls, defined once: their kinds ([`CallKind`], with the API's
//! names and the nccl-tests bus factor), the wire codes of reduce operators, and the
//! [`Fingerprint`] every message of a collective carries so that ranks which called different
//! collectives (or the same one differently) find out.
//!
//! Owns: names, codes and descriptions. Must not know: how a collective runs, or how a
//! fingerprint travels (the transports carry it as opaque bytes of their frame header).

use crate::dtype::DType;
use crate::reduce::ReduceOp;

/// What a message or a call belongs to: point-to-point or one of the collectives. The value is
/// the fingerprint's `kind` on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum CallKind {
    PointToPoint = 0,
    AllReduce = 1,
    Broadcast = 2,
    Reduce = 3,
    AllGather = 4,
    Gather = 5,
    Scatter = 6,
    ReduceScatter = 7,
    AllToAll = 8,
    Barrier = 9,
}

/// Names of fingerprint kinds on the wire (index = `kind`): the API's names.
pub const KIND_NAMES: [&str; 10] = [
    "point-to-point",
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
    "barrier",
];

/// Names of reduce operators on the wire (index = `op`; 0: none).
pub const OP_NAMES: [&str; 9] = [
    "", "sum", "product", "min", "max", "avg", "band", "bor", "bxor",
];

impl CallKind {
    /// Every kind, in wire order.
    pub const ALL: [CallKind; 10] = [
        CallKind::PointToPoint,
        CallKind::AllReduce,
        CallKind::Broadcast,
        CallKind::Reduce,
        CallKind::AllGather,
        CallKind::Gather,
        CallKind::Scatter,
        CallKind::ReduceScatter,
        CallKind::AllToAll,
        CallKind::Barrier,
    ];

    /// The API's name (`"all_reduce"`, ...).
    pub fn name(self) -> &'static str {
        KIND_NAMES[self as usize]
    }

    /// The kind of wire code `code`.
    pub fn from_code(code: u8) -> Option<CallKind> {
        CallKind::ALL.get(usize::from(code)).copied()
    }

    /// The kind named `name` (as [`CallKind::name`] spells it).
    pub fn from_name(name: &str) -> Option<CallKind> {
        CallKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Whether calls of this kind have a root rank.
    pub fn has_root(self) -> bool {
        matches!(
            self,
            CallKind::Broadcast | CallKind::Reduce | CallKind::Gather | CallKind::Scatter
        )
    }

    /// The nccl-tests bus-bandwidth factor on `n` ranks: busbw = algbw × factor.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            CallKind::AllReduce => 2.0 * (n - 1.0) / n,
            CallKind::Broadcast | CallKind::Reduce | CallKind::PointToPoint => 1.0,
            CallKind::Barrier => 0.0,
            _ => (n - 1.0) / n,
        }
    }
}

/// The wire code of reduce operator `op` (see [`OP_NAMES`]).
pub fn op_code(op: ReduceOp) -> u8 {
    match op {
        ReduceOp::Sum => 1,
        ReduceOp::Product => 2,
        ReduceOp::Min => 3,
        ReduceOp::Max => 4,
        ReduceOp::Avg => 5,
        ReduceOp::BAnd => 6,
        ReduceOp::BOr => 7,
        ReduceOp::BXor => 8,
    }
}

/// What a collective call was: kind, operator, root and element count. Zero for point-to-point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Fingerprint {
    pub kind: u8,
    pub op: u8,
    pub root: u32,
    pub count: u64,
}

impl Fingerprint {
    /// Point-to-point messages carry no fingerprint.
    pub const NONE: Fingerprint = Fingerprint {
        kind: CallKind::PointToPoint as u8,
        op: 0,
        root: 0,
        count: 0,
    };

    /// The messages of a barrier.
    pub const BARRIER: Fingerprint = Fingerprint {
        kind: CallKind::Barrier as u8,
        ..Fingerprint::NONE
    };

    /// The fingerprint of a call of `kind` over `count` elements.
    pub fn of(kind: CallKind, op: Option<ReduceOp>, root: usize, count: usize) -> Fingerprint {
        Fingerprint {
            kind: kind as u8,
            op: op.map_or(0, op_code),
            root: root as u32,
            count: count as u64,
        }
    }

    /// Whether this is the empty fingerprint of a point-to-point message.
    pub fn is_point_to_point(&self) -> bool {
        self.kind == CallKind::PointToPoint as u8
    }

    /// Human-readable description, e.g. `all_reduce(op=sum, count=10, dtype=f32)`.
    pub fn describe(&self, dtype: DType) -> String {
        let kind = CallKind::from_code(self.kind);
        let mut s = format!("{}(", kind.map_or("unknown", CallKind::name));
        if let Some(op) = OP_NAMES.get(self.op as usize).filter(|o| !o.is_empty()) {
            s += &format!("op={op}, ");
        }
        if kind.is_some_and(CallKind::has_root) {
            s += &format!("root={}, ", self.root);
        }
        s + &format!("count={}, dtype={dtype})", self.count)
    }
}

/// Everything about a posted operation except its buffer and its peer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Envelope {
    /// The API operation, for errors.
    pub op: &'static str,
    pub dtype: DType,
    /// Communication context (group and kind of traffic).
    pub ctx: u32,
    pub tag: u32,
    /// The check word, compared with the receive's and never interpreted; a non-empty one
    /// makes the message *scheduled* (see the transport's `protocol::refusal`): exact size, no answer awaited.
    /// [`Fingerprint::NONE`] for ordinary messages.
    pub fp: Fingerprint,
}

/// One collective call as every rank must see it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Call {
    pub kind: CallKind,
    pub op: Option<ReduceOp>,
    pub root: usize,
    pub count: usize,
    /// The call's size in the nccl-tests sense (for the comms log).
    pub bytes: usize,
    /// Part of a composite operation that logs itself (1-bit all_reduce): not logged alone.
    pub quiet: bool,
    /// The algorithm that runs it (`DISTCOMM_DEBUG=DEBUG`).
    pub algo: &'static str,
}

impl Call {
    pub(crate) fn new(kind: CallKind, count: usize) -> Call {
        Call {
            kind,
            op: None,
            root: 0,
            count,
            bytes: 0,
            quiet: false,
            algo: match kind {
                CallKind::AllReduce => "recursive doubling",
                CallKind::Broadcast | CallKind::Reduce => "binomial tree",
                CallKind::AllGather | CallKind::ReduceScatter => "ring",
                CallKind::Gather | CallKind::Scatter | CallKind::AllToAll => "direct",
                CallKind::Barrier => "dissemination",
                CallKind::PointToPoint => "direct",
            },
        }
    }
    pub(crate) fn algo(mut self, algo: &'static str) -> Call {
        self.algo = algo;
        self
    }
    pub(crate) fn quiet(mut self, quiet: bool) -> Call {
        self.quiet = quiet;
        self
    }
    pub(crate) fn bytes(mut self, bytes: usize) -> Call {
        self.bytes = bytes;
        self
    }
    pub(crate) fn op(mut self, op: ReduceOp) -> Call {
        self.op = Some(op);
        self
    }
    pub(crate) fn root(mut self, root: usize) -> Call {
        self.root = root;
        self
    }
    pub(crate) fn fingerprint(&self) -> Fingerprint {
        Fingerprint::of(self.kind, self.op, self.root, self.count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_names_and_kinds_agree() {
        for (i, k) in CallKind::ALL.into_iter().enumerate() {
            assert_eq!(k as usize, i);
            assert_eq!(CallKind::from_code(i as u8), Some(k));
            assert_eq!(CallKind::from_name(k.name()), Some(k));
        }
        assert_eq!(CallKind::from_code(10), None);
        assert_eq!(CallKind::from_name("onebit_all_reduce"), None);
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::BXor] {
            assert!(!OP_NAMES[op_code(op) as usize].is_empty());
        }
    }

    #[test]
    fn fingerprints_describe_themselves() {
        let fp = Fingerprint::of(CallKind::Broadcast, None, 2, 10);
        assert_eq!(
            fp.describe(DType::F32),
            "broadcast(root=2, count=10, dtype=f32)"
        );
        let fp = Fingerprint::of(CallKind::AllReduce, Some(ReduceOp::Sum), 0, 3);
        assert_eq!(
            fp.describe(DType::I64),
            "all_reduce(op=sum, count=3, dtype=i64)"
        );
        assert!(Fingerprint::NONE.is_point_to_point());
        assert!(!Fingerprint::BARRIER.is_point_to_point());
        let odd = Fingerprint {
            kind: 200,
            ..Fingerprint::NONE
        };
        assert!(odd.describe(DType::U8).starts_with("unknown("));
    }
}
