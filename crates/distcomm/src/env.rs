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

type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

fn parse<T: std::str::FromStr>(name: &str, value: &str) -> Result<T> {
    value
        .trim()
        .parse()
        .map_err(|_| Error::Config(format!("{name}={value:?} is not a valid number")))
}

/// Reads a set of required variables; reports every missing one at once.
fn require(var: Lookup<'_>, names: &[&str]) -> Result<Vec<String>> {
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

fn master_from(var: Lookup<'_>, names: &[&str], all_local: bool) -> Result<String> {
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

fn port_from(var: Lookup<'_>, names: &[&str]) -> Result<u16> {
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
        Self::from_lookup(&|n| env::var(n).ok())
    }

    /// Like [`from_env`](Self::from_env) with variables from `get` (for tests and embedding).
    ///
    /// ```
    /// use distcomm::env::JobEnv;
    /// let vars = [("RANK", "1"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500")];
    /// let job = JobEnv::from_lookup(&|n| vars.iter().find(|v| v.0 == n).map(|v| v.1.to_string())).unwrap();
    /// assert_eq!((job.rank, job.world), (1, 4));
    /// ```
    pub fn from_lookup(get: Lookup<'_>) -> Result<JobEnv> {
        let var = &|n: &str| get(n).filter(|v| !v.is_empty());
        let job = if var("RANK").is_some() || var("WORLD_SIZE").is_some() {
            let v = require(var, &["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"])?;
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
            let v = require(var, &["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"])?;
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
                master_addr: master_from(
                    var,
                    &["DISTCOMM_MASTER_ADDR", "MASTER_ADDR"],
                    local_world == world,
                )?,
                master_port: port_from(var, &["DISTCOMM_MASTER_PORT", "MASTER_PORT"])?,
                agent_store: false,
                launcher: Launcher::OpenMpi,
            }
        } else if var("SLURM_PROCID").is_some() {
            let v = require(var, &["SLURM_PROCID", "SLURM_NTASKS"])?;
            let rank = parse("SLURM_PROCID", &v[0])?;
            let world: usize = parse("SLURM_NTASKS", &v[1])?;
            let nnodes: usize = var("SLURM_NNODES").map_or(Ok(1), |x| parse("SLURM_NNODES", &x))?;
            let local_world = var("SLURM_NTASKS_PER_NODE")
                .and_then(|x| x.split(['(', ',']).next().map(str::to_string))
                .map_or(Ok(world.div_ceil(nnodes.max(1))), |x| {
                    parse("SLURM_NTASKS_PER_NODE", &x)
                })?;
            JobEnv {
                rank,
                world,
                local_rank: var("SLURM_LOCALID").map_or(Ok(0), |x| parse("SLURM_LOCALID", &x))?,
                local_world,
                master_addr: master_from(
                    var,
                    &["DISTCOMM_MASTER_ADDR", "MASTER_ADDR"],
                    nnodes == 1,
                )?,
                master_port: port_from(var, &["DISTCOMM_MASTER_PORT", "MASTER_PORT"])?,
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
                    "(or OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE, or SLURM_PROCID/SLURM_NTASKS)"
                        .into(),
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
        let var = |n: &str| env::var(n).ok().filter(|v| !v.is_empty());
        [
            "RANK",
            "WORLD_SIZE",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "SLURM_PROCID",
        ]
        .iter()
        .any(|n| var(n).is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(vars: &[(&str, &str)]) -> Result<JobEnv> {
        JobEnv::from_lookup(&|n| vars.iter().find(|v| v.0 == n).map(|v| v.1.to_string()))
    }

    #[test]
    fn torchrun() {
        let j = job(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ])
        .unwrap();
        assert_eq!((j.rank, j.world, j.local_rank, j.local_world), (3, 8, 1, 2));
        assert_eq!((j.master_addr.as_str(), j.master_port), ("node0", 1234));
        assert!(j.agent_store);
        assert_eq!(j.launcher, Launcher::Torchrun);
    }

    #[test]
    fn missing_variables_are_all_named() {
        match job(&[("RANK", "0")]) {
            Err(Error::MissingEnv { missing }) => {
                assert_eq!(missing, vec!["WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"])
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(job(&[]), Err(Error::MissingEnv { .. })));
        let e = job(&[("SLURM_PROCID", "0")]).unwrap_err().to_string();
        assert!(e.contains("SLURM_NTASKS"), "{e}");
    }

    #[test]
    fn open_mpi_and_slurm() {
        let j = job(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap();
        assert_eq!((j.rank, j.world, j.launcher), (1, 2, Launcher::OpenMpi));
        assert_eq!(
            (j.master_addr.as_str(), j.master_port),
            ("127.0.0.1", DEFAULT_MASTER_PORT)
        );
        // Multi-host Open MPI needs a master address.
        let e = job(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("DISTCOMM_MASTER_ADDR"), "{e}");
        let j = job(&[
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NNODES", "2"),
            ("SLURM_NTASKS_PER_NODE", "2(x2)"),
            ("MASTER_ADDR", "10.1.1.1"),
        ])
        .unwrap();
        assert_eq!(
            (j.rank, j.world, j.local_world, j.launcher),
            (2, 4, 2, Launcher::Slurm)
        );
    }

    #[test]
    fn bad_values() {
        let e = job(&[
            ("RANK", "x"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "1"),
        ]);
        assert!(matches!(e, Err(Error::Config(_))));
        let e = job(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "1"),
        ]);
        assert!(matches!(e, Err(Error::Config(_))));
    }
}
