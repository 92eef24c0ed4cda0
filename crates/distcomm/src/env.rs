//! Discovery of rank, world and master from the environment a launcher leaves behind:
//! torchrun (and `distcomm launch`), Open MPI's `mpirun`, and Slurm's `srun`.

use std::env;

use crate::error::{Error, Result};

/// The launcher whose variables described the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun's variables (also set by `distcomm launch`).
    Torchrun,
    /// Open MPI's `OMPI_COMM_WORLD_*`.
    OpenMpi,
    /// Slurm's `SLURM_*`.
    Slurm,
}

/// What the environment says about this process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobEnv {
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    pub local_world: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// True under torchrun's agent store (`TORCHELASTIC_USE_AGENT_STORE=True`): every rank is a
    /// client and nobody hosts the store.
    pub agent_store: bool,
    pub launcher: Launcher,
}

/// torch's default master port.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

fn var(name: &str) -> Option<String> {
    env::var(name).ok().filter(|v| !v.is_empty())
}

fn parse<T: std::str::FromStr>(name: &str, value: &str) -> Result<T> {
    value
        .trim()
        .parse()
        .map_err(|_| Error::Config(format!("{name}={value:?} is not a valid number")))
}

/// Reads a set of required variables; reports every missing one at once.
fn require(names: &[&str]) -> Result<Vec<String>> {
    let vals: Vec<Option<String>> = names.iter().map(|n| var(n)).collect();
    let missing: Vec<String> = names
        .iter()
        .zip(&vals)
        .filter(|(_, v)| v.is_none())
        .map(|(n, _)| n.to_string())
        .collect();
    if !missing.is_empty() {
        return Err(Error::MissingEnv { missing });
    }
    Ok(vals.into_iter().flatten().collect())
}

fn master_from(names: &[&str], all_local: bool) -> Result<String> {
    for n in names {
        if let Some(v) = var(n) {
            return Ok(v);
        }
    }
    if all_local {
        return Ok("127.0.0.1".into());
    }
    Err(Error::MissingEnv {
        missing: vec![names.join(" or ")],
    })
}

fn port_from(names: &[&str]) -> Result<u16> {
    for n in names {
        if let Some(v) = var(n) {
            return parse(n, &v);
        }
    }
    Ok(DEFAULT_MASTER_PORT)
}

impl JobEnv {
    /// Detects the job from the environment: torchrun's variables first, then Open MPI's, then
    /// Slurm's. An incomplete set is an error naming every missing variable.
    ///
    /// ```no_run
    /// let job = distcomm::env::JobEnv::from_env()?;
    /// println!("rank {} of {}", job.rank, job.world);
    /// # Ok::<(), distcomm::Error>(())
    /// ```
    pub fn from_env() -> Result<JobEnv> {
        let job = if var("RANK").is_some() || var("WORLD_SIZE").is_some() {
            let v = require(&["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"])?;
            let rank = parse("RANK", &v[0])?;
            let world = parse("WORLD_SIZE", &v[1])?;
            JobEnv {
                rank,
                world,
                local_rank: var("LOCAL_RANK").map_or(Ok(rank), |x| parse("LOCAL_RANK", &x))?,
                local_world: var("LOCAL_WORLD_SIZE")
                    .map_or(Ok(world), |x| parse("LOCAL_WORLD_SIZE", &x))?,
                master_addr: v[2].clone(),
                master_port: parse("MASTER_PORT", &v[3])?,
                agent_store: var("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Some("True"),
                launcher: Launcher::Torchrun,
            }
        } else if var("OMPI_COMM_WORLD_RANK").is_some() || var("OMPI_COMM_WORLD_SIZE").is_some() {
            let v = require(&["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"])?;
            let rank = parse("OMPI_COMM_WORLD_RANK", &v[0])?;
            let world: usize = parse("OMPI_COMM_WORLD_SIZE", &v[1])?;
            let local_world = var("OMPI_COMM_WORLD_LOCAL_SIZE")
                .map_or(Ok(world), |x| parse("OMPI_COMM_WORLD_LOCAL_SIZE", &x))?;
            JobEnv {
                rank,
                world,
                local_rank: var("OMPI_COMM_WORLD_LOCAL_RANK")
                    .map_or(Ok(rank), |x| parse("OMPI_COMM_WORLD_LOCAL_RANK", &x))?,
                local_world,
                master_addr: master_from(&["DISTCOMM_MASTER_ADDR", "MASTER_ADDR"], local_world == world)?,
                master_port: port_from(&["DISTCOMM_MASTER_PORT", "MASTER_PORT"])?,
                agent_store: false,
                launcher: Launcher::OpenMpi,
            }
        } else if var("SLURM_PROCID").is_some() {
            let v = require(&["SLURM_PROCID", "SLURM_NTASKS"])?;
            let rank = parse("SLURM_PROCID", &v[0])?;
            let world: usize = parse("SLURM_NTASKS", &v[1])?;
            let nnodes: usize = var("SLURM_NNODES").map_or(Ok(1), |x| parse("SLURM_NNODES", &x))?;
            let local_world = var("SLURM_NTASKS_PER_NODE")
                .and_then(|x| x.split(['(', ',']).next().map(str::to_string))
                .map_or(Ok(world.div_ceil(nnodes.max(1))), |x| parse("SLURM_NTASKS_PER_NODE", &x))?;
            JobEnv {
                rank,
                world,
                local_rank: var("SLURM_LOCALID").map_or(Ok(0), |x| parse("SLURM_LOCALID", &x))?,
                local_world,
                master_addr: master_from(&["DISTCOMM_MASTER_ADDR", "MASTER_ADDR"], nnodes == 1)?,
                master_port: port_from(&["DISTCOMM_MASTER_PORT", "MASTER_PORT"])?,
                agent_store: false,
                launcher: Launcher::Slurm,
            }
        } else {
            return Err(Error::MissingEnv {
                missing: vec![
                    "RANK".into(),
                    "WORLD_SIZE".into(),
                    "MASTER_ADDR".into(),
                    "MASTER_PORT".into(),
                    "(or OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE, or SLURM_PROCID/SLURM_NTASKS)".into(),
                ],
            });
        };
        if job.world == 0 || job.rank >= job.world {
            return Err(Error::Config(format!(
                "rank {} is not inside a world of {}",
                job.rank, job.world
            )));
        }
        Ok(job)
    }

    /// True when some launcher's variables are present (complete or not).
    pub fn present() -> bool {
        ["RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID"]
            .iter()
            .any(|n| var(n).is_some())
    }
}
