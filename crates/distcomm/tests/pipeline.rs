//! Pipeline-stage point-to-point over real processes: tensors of every element type and of
//! rank 0 to 4 round the ring of stages (last → first included), posted receive-first and
//! send-first, eager and large; byte objects of sizes the receiver does not know; typed errors
//! for a wrong element type; forward and backward traffic between the same two stages kept
//! apart.

mod common;

use common::{run, run_native};
use distcomm::{Element, Error, PipeStage, ProcessGroup, Tensor};
use half::{bf16, f16};

/// Shapes of rank 0 to 4, including empty ones and one large enough to go by rendezvous.
fn shapes(stage: usize) -> Vec<Vec<usize>> {
    vec![
        vec![],
        vec![0],
        vec![5 + stage],
        vec![3, 7],
        vec![2, 0, 4],
        vec![2, 3, 5, 7],
        vec![64, 33, 17 + stage],
    ]
}

fn value<T: Element + FromF64>(stage: usize, i: usize) -> T {
    T::from_f64(((i * 31 + stage * 7) % 97) as f64 - 40.0)
}

trait FromF64 {
    fn from_f64(v: f64) -> Self;
}

macro_rules! from_f64 {
    ($($t:ty => $e:expr),* $(,)?) => {$(
        impl FromF64 for $t {
            fn from_f64(v: f64) -> Self {
                let f: fn(f64) -> $t = $e;
                f(v)
            }
        }
    )*};
}

from_f64!(
    u8 => |v| v as i64 as u8,
    i8 => |v| v as i8,
    i32 => |v| v as i32,
    i64 => |v| v as i64,
    f32 => |v| v as f32,
    f64 => |v| v,
    f16 => f16::from_f64,
    bf16 => bf16::from_f64,
);

fn tensor<T: Element + FromF64>(stage: usize, shape: Vec<usize>) -> Tensor<T> {
    let n = shape.iter().product();
    Tensor::new(shape, (0..n).map(|i| value(stage, i)).collect()).expect("valid shape")
}

/// Every stage sends each shape forward and receives its predecessor's, in both posting
/// orders, all in flight at once.
fn ring_of<T: Element + FromF64 + PartialEq + std::fmt::Debug>(g: &ProcessGroup) {
    let stage = PipeStage::new(g);
    for recv_first in [true, false] {
        let mut recvs = Vec::new();
        let mut sends = Vec::new();
        if recv_first {
            for _ in shapes(0) {
                recvs.push(stage.recv_forward::<T>().expect("post recv"));
            }
        }
        for shape in shapes(stage.stage()) {
            sends.push(
                stage
                    .send_forward(tensor::<T>(stage.stage(), shape))
                    .expect("send"),
            );
        }
        if !recv_first {
            for _ in shapes(0) {
                recvs.push(stage.recv_forward::<T>().expect("post recv"));
            }
        }
        for (w, shape) in recvs.into_iter().zip(shapes(stage.prev())) {
            let got = w.into_tensor().expect("receive");
            assert_eq!(got, tensor::<T>(stage.prev(), shape), "{}", T::DTYPE);
        }
        for (w, shape) in sends.into_iter().zip(shapes(stage.stage())) {
            let back = w.into_tensor().expect("send completes");
            assert_eq!(back.shape, shape);
        }
    }
}

#[test]
fn tensors_of_every_type_and_rank_go_round_the_stages() {
    run(
        "tensors_of_every_type_and_rank_go_round_the_stages",
        &[2, 3, 4],
        |g| {
            ring_of::<u8>(g);
            ring_of::<i8>(g);
            ring_of::<i32>(g);
            ring_of::<i64>(g);
            ring_of::<f32>(g);
            ring_of::<f64>(g);
            ring_of::<f16>(g);
            ring_of::<bf16>(g);
        },
    );
}

#[test]
fn forward_and_backward_between_two_stages_stay_apart() {
    run(
        "forward_and_backward_between_two_stages_stay_apart",
        &[2, 3],
        |g| {
            let stage = PipeStage::new(g);
            // Micro-batches forward, gradients backward, all posted before anything is waited.
            let fwd_in: Vec<_> = (0..4)
                .map(|_| stage.recv_forward::<f32>().unwrap())
                .collect();
            let bwd_in: Vec<_> = (0..4)
                .map(|_| stage.recv_backward::<f32>().unwrap())
                .collect();
            let mut outs = Vec::new();
            for mb in 0..4usize {
                let act = Tensor::new(vec![mb + 1], vec![(stage.stage() * 10 + mb) as f32; mb + 1]);
                let grad = Tensor::new(vec![2], vec![-((stage.stage() * 10 + mb) as f32); 2]);
                outs.push(stage.send_forward(act.unwrap()).unwrap());
                outs.push(stage.send_backward(grad.unwrap()).unwrap());
            }
            for (mb, w) in fwd_in.into_iter().enumerate() {
                let t = w.into_tensor().unwrap();
                assert_eq!(t.data, vec![(stage.prev() * 10 + mb) as f32; mb + 1]);
            }
            for (mb, w) in bwd_in.into_iter().enumerate() {
                let t = w.into_tensor().unwrap();
                assert_eq!(t.data, vec![-((stage.next() * 10 + mb) as f32); 2]);
            }
            for w in outs {
                w.wait().unwrap();
            }
        },
    );
}

#[test]
fn a_tensor_of_the_wrong_type_is_a_typed_error_on_both_sides() {
    run_native(
        "a_tensor_of_the_wrong_type_is_a_typed_error_on_both_sides",
        &[2],
        |g| {
            if g.rank() == 0 {
                let t = Tensor::new(vec![2, 2], vec![1f64; 4]).unwrap();
                let err = g.isend_tensor(t, 1, 3).unwrap().wait().unwrap_err();
                assert!(matches!(err, Error::DTypeMismatch { .. }), "{err}");
            } else {
                let err = g.recv_tensor::<f32>(0, 3).unwrap_err();
                assert!(matches!(err, Error::DTypeMismatch { .. }), "{err}");
            }
            // The pair still works afterwards.
            let peer = 1 - g.rank();
            let r = g.irecv_tensor::<i32>(peer, 4).unwrap();
            g.send_tensor(Tensor::new(vec![1], vec![7i32]).unwrap(), peer, 4)
                .unwrap();
            r.wait().unwrap();
            assert_eq!(r.into_tensor().unwrap().data, vec![7]);
        },
    );
}

#[test]
fn objects_of_sizes_the_receiver_does_not_know() {
    run(
        "objects_of_sizes_the_receiver_does_not_know",
        &[2, 3],
        |g| {
            let n = g.size();
            let (next, prev) = ((g.rank() + 1) % n, (g.rank() + n - 1) % n);
            let sizes = [0usize, 1, 100, 16 * 1024 + 3, 3 << 20];
            let recvs: Vec<_> = sizes
                .iter()
                .map(|_| g.irecv_object(prev, 9).unwrap())
                .collect();
            let sends: Vec<_> = sizes
                .iter()
                .map(|&s| g.isend_object(common::pattern((g.rank() * 100 + s) as u64, s), next, 9))
                .collect();
            for (w, &s) in recvs.into_iter().zip(&sizes) {
                assert_eq!(
                    w.into_buffer().unwrap(),
                    common::pattern((prev * 100 + s) as u64, s)
                );
            }
            for w in sends {
                w.unwrap().into_buffer().unwrap();
            }
        },
    );
}

#[test]
fn invalid_tensors_and_peers_are_refused_before_anything_is_sent() {
    run(
        "invalid_tensors_and_peers_are_refused_before_anything_is_sent",
        &[2],
        |g| {
            let bad = Tensor {
                shape: vec![3],
                data: vec![1f32; 2],
            };
            let err = g.isend_tensor(bad, 1 - g.rank(), 0).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
            let t = Tensor::new(vec![1], vec![1f32]).unwrap();
            assert!(matches!(
                g.isend_tensor(t, 5, 0).unwrap_err(),
                Error::InvalidRank { .. }
            ));
            assert!(matches!(
                g.irecv_tensor::<f32>(0, distcomm::MAX_TAG + 1).unwrap_err(),
                Error::TagOutOfRange { .. }
            ));
            g.barrier().unwrap();
        },
    );
}
