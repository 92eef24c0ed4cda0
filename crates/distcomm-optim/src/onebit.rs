//! 1-bit Adam (DeepSpeed's `OnebitAdam`): data-parallel Adam whose momentum, after a warm-up,
//! crosses the network as one bit per element.
//!
//! * **Warm-up** (steps `1..=freeze_step`): the gradients are averaged exactly
//!   (`all_reduce`), then both moments and the parameters are updated as by Adam without bias
//!   correction, with decoupled weight decay:
//!   `p -= lr · (m / (√v + ε) + wd · p)`.
//! * **Compression stage** (after): the variance `v` is frozen; each rank folds its *local*
//!   gradient into the momentum (`m = β₁·m + (1 − β₁)·g`), the momentum is averaged with
//!   [`ProcessGroup::onebit_all_reduce`] (error feedback kept here, per optimizer), and the
//!   parameters are updated with the same formula. Every rank ends each step with the same
//!   parameters.
//!
//! 1-bit compression cannot represent zero: a parameter whose gradient was exactly zero all
//! through the warm-up (frozen `v = 0`, say a padding row of an embedding) would be pushed by
//! `scale / ε` every step. DeepSpeed asks the user for a momentum mask; here the mask is taken
//! at the freeze, from the elements whose variance is exactly zero (the same on every rank, as
//! the warm-up used averaged gradients), and their momentum is held at zero.
//!
//! Parameters are one flat `f32` buffer (flatten several tensors into it, as DeepSpeed does).

use distcomm::{OneBitState, ProcessGroup, ReduceOp};

use crate::{Adam, AdamConfig, Mode, OptimError, Tensor};

/// Hyper-parameters of [`OnebitAdam`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OnebitAdamConfig {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Decoupled weight decay (as DeepSpeed: added to the update, scaled by `lr`).
    pub weight_decay: f32,
    /// Steps of exact warm-up before the variance freezes and compression starts.
    pub freeze_step: u64,
}

impl Default for OnebitAdamConfig {
    fn default() -> Self {
        OnebitAdamConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            freeze_step: 100,
        }
    }
}

/// What a 1-bit Adam step can fail with.
#[derive(Debug, Clone, thiserror::Error)]
pub enum OnebitError {
    #[error(transparent)]
    Optim(#[from] OptimError),
    #[error(transparent)]
    Comm(#[from] distcomm::Error),
}

/// 1-bit Adam over one flat `f32` parameter buffer (see the module).
///
/// ```no_run
/// use distcomm_optim::{OnebitAdam, OnebitAdamConfig};
/// # fn main() -> Result<(), distcomm_optim::OnebitError> {
/// let group = distcomm::init()?;
/// let mut params = vec![0.1f32; 1000];
/// let mut opt = OnebitAdam::new(OnebitAdamConfig { freeze_step: 10, ..Default::default() }, params.len())?;
/// for _ in 0..20 {
///     let mut grads = vec![0.01f32; 1000]; // this rank's gradients
///     opt.step(&group, &mut params, &mut grads)?;
/// }
/// assert!(opt.compressing());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct OnebitAdam {
    cfg: OnebitAdamConfig,
    /// The fused Adam of the warm-up (AdamW form, no bias correction).
    warmup: Adam,
    step: u64,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    errors: OneBitState,
    /// Indices of elements whose variance froze at zero (taken at the first compressed step).
    masked: Option<Vec<usize>>,
}

impl OnebitAdam {
    /// An optimizer for `len` parameters (checks the hyper-parameters as [`Adam::new`] does).
    pub fn new(cfg: OnebitAdamConfig, len: usize) -> Result<OnebitAdam, OptimError> {
        let warmup = Adam::new(AdamConfig {
            lr: cfg.lr,
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.eps,
            weight_decay: cfg.weight_decay,
            mode: Mode::AdamW,
            bias_correction: false,
        })?;
        Ok(OnebitAdam {
            cfg,
            warmup,
            step: 0,
            exp_avg: vec![0.0; len],
            exp_avg_sq: vec![0.0; len],
            errors: OneBitState::default(),
            masked: None,
        })
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Changes the learning rate (for schedules); checked as [`Adam::set_lr`] does.
    pub fn set_lr(&mut self, lr: f32) -> Result<(), OptimError> {
        self.warmup.set_lr(lr)?;
        self.cfg.lr = lr;
        Ok(())
    }

    /// Whether the next step compresses (the warm-up is over).
    pub fn compressing(&self) -> bool {
        self.step >= self.cfg.freeze_step
    }

    /// One step with this rank's gradients `grads` (overwritten: averaged in place during the
    /// warm-up). Every rank of `group` must call it with its own gradients, in step.
    pub fn step(
        &mut self,
        group: &ProcessGroup,
        params: &mut [f32],
        grads: &mut [f32],
    ) -> Result<(), OnebitError> {
        let n = self.exp_avg.len();
        if params.len() != n || grads.len() != n {
            return Err(OptimError::Length {
                param: params.len(),
                grad: grads.len(),
                m: n,
                v: n,
            }
            .into());
        }
        if !self.compressing() {
            group.all_reduce(grads, ReduceOp::Avg)?;
            let t = Tensor::new(params, grads, &mut self.exp_avg, &mut self.exp_avg_sq)?;
            self.warmup.step(&mut [t])?;
            self.step += 1;
            return Ok(());
        }
        let c = &self.cfg;
        let one_minus_beta1 = 1.0 - c.beta1;
        for (m, g) in self.exp_avg.iter_mut().zip(grads.iter()) {
            *m += one_minus_beta1 * (g - *m);
        }
        group.onebit_all_reduce(&mut self.exp_avg, &mut self.errors)?;
        let v = &self.exp_avg_sq;
        let masked = self
            .masked
            .get_or_insert_with(|| (0..v.len()).filter(|&i| v[i] == 0.0).collect());
        for &i in masked.iter() {
            self.exp_avg[i] = 0.0;
        }
        let decay = 1.0 - c.lr * c.weight_decay;
        let it = params.iter_mut().zip(&self.exp_avg).zip(&self.exp_avg_sq);
        for ((p, m), v) in it {
            *p = *p * decay - c.lr * (m / (v.sqrt() + c.eps));
        }
        self.step += 1;
        Ok(())
    }
}
