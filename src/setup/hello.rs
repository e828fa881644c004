//! The first message: what every rank tells the others before allocating anything, and the
//! checks every rank makes on everyone's.

use crate::config::{tuning_disagreement, tuning_label};
use crate::error::{Error, Result};
use crate::topology::RankPlacement;
use crate::wire::{Reader, Wire, Writer};

/// One rank's introduction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) world: usize,
    pub(crate) device: [u8; 16],
    pub(crate) ordinal: usize,
    pub(crate) host_id: [u8; 16],
    /// [`crate::Config::fingerprint`].
    pub(crate) config: Vec<u8>,
    pub(crate) host: String,
}

impl Wire for Hello {
    fn put(&self, w: &mut Writer) {
        w.put(&self.world)
            .put(&self.device)
            .put(&self.ordinal)
            .put(&self.host_id)
            .put(&self.config)
            .put(&self.host);
    }

    fn take(r: &mut Reader<'_>) -> Option<Self> {
        Some(Hello {
            world: r.take()?,
            device: r.take()?,
            ordinal: r.take()?,
            host_id: r.take()?,
            config: r.take()?,
            host: r.take()?,
        })
    }
}

impl Hello {
    /// The placement it announces.
    pub(crate) fn placement(&self) -> RankPlacement {
        RankPlacement {
            host: self.host.clone(),
            host_id: self.host_id,
            device_uuid: self.device,
            ordinal: self.ordinal,
        }
    }
}

/// Decodes every rank's hello and checks it against this rank's: the same world and the
/// same configuration everywhere.
pub(crate) fn check_all(own: &Hello, gathered: &[Vec<u8>]) -> Result<Vec<Hello>> {
    let hellos: Vec<Hello> = gathered
        .iter()
        .map(|b| Hello::from_wire(b).ok_or_else(|| Error::malformed("hello")))
        .collect::<Result<_>>()?;
    if hellos.len() != own.world {
        return Err(Error::malformed("hello"));
    }
    for (q, h) in hellos.iter().enumerate() {
        if h.world != own.world {
            return Err(Error::InvalidWorldSize {
                world: own.world,
                reason: format!("rank {q} was created for a world of {}", h.world),
            });
        }
        if h.config != own.config {
            if let Some((ours, theirs)) = tuning_disagreement(&own.config, &h.config) {
                return Err(Error::TuningMismatch {
                    rank: q,
                    ours: tuning_label(ours),
                    theirs: tuning_label(theirs),
                });
            }
            return Err(Error::InvalidConfig(format!(
                "rank {q} uses a different Config; every rank must pass the same one"
            )));
        }
    }
    Ok(hellos)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn hello(host: &str, config: &Config) -> Hello {
        Hello {
            world: 2,
            device: [7; 16],
            ordinal: 3,
            host_id: [9; 16],
            config: config.fingerprint(),
            host: host.to_string(),
        }
    }

    #[test]
    fn hello_round_trips_with_any_host_name() {
        for host in ["", "gpu-node-17.cluster.example", "ünïcode"] {
            let h = hello(host, &Config::default());
            assert_eq!(Hello::from_wire(&h.to_wire()), Some(h.clone()));
            let bytes = h.to_wire();
            for cut in 0..bytes.len() {
                assert_eq!(Hello::from_wire(&bytes[..cut]), None);
            }
        }
    }

    #[test]
    fn a_different_world_or_config_is_refused_by_every_rank() {
        let c = Config::default();
        let own = hello("a", &c);
        let same = vec![own.to_wire(), hello("b", &c).to_wire()];
        assert_eq!(check_all(&own, &same).unwrap().len(), 2);
        let other_config = Config {
            nccl_above_bytes: Some(0),
            ..Config::default()
        };
        let mixed = vec![own.to_wire(), hello("b", &other_config).to_wire()];
        assert!(matches!(check_all(&own, &mixed), Err(Error::InvalidConfig(_))));
        let mut bigger = hello("b", &c);
        bigger.world = 4;
        let mixed = vec![own.to_wire(), bigger.to_wire()];
        assert!(matches!(
            check_all(&own, &mixed),
            Err(Error::InvalidWorldSize { world: 2, .. })
        ));
        assert!(matches!(
            check_all(&own, &[own.to_wire()]),
            Err(Error::PeerSetupFailed { rank: None, .. })
        ));
        assert!(check_all(&own, &[own.to_wire(), vec![1, 2, 3]]).is_err());
    }

    fn table(one_shot: usize) -> crate::config::TuningTable {
        use crate::config::{Crossovers, Measured, TuningTable};
        use crate::dtype::DType;
        let entry = Crossovers {
            dtype: DType::F32,
            world: 3,
            low_latency_max_bytes: 0,
            two_shot_ll_max_bytes: None,
            one_shot_max_bytes: one_shot,
            two_shot_max_bytes: None,
        };
        TuningTable::new(Measured::default(), vec![entry]).unwrap()
    }

    /// Every rank checks every hello, so a rank whose table differs makes setup fail on every
    /// rank, each with the typed error naming a rank that disagrees with it.
    #[test]
    fn ranks_disagreeing_on_the_tuning_table_fail_on_every_rank() {
        let other = Config::default().with_tuning(table(2 << 20));
        // The same all-reduce crossovers, another fused one-shot limit.
        let fused = |one_shot_max_tokens| crate::config::FusedCrossovers {
            dtype: crate::dtype::DType::F32,
            world: 3,
            hidden: 4096,
            one_shot_max_tokens,
        };
        let same = Config::default().with_tuning(table(1 << 20).with_fused(vec![fused(8)]).unwrap());
        let other_fused = Config::default().with_tuning(table(1 << 20).with_fused(vec![fused(9)]).unwrap());
        let no_fused = Config::default().with_tuning(table(1 << 20));
        for (odd_one, odd_config) in [
            (2usize, other.clone()),
            (0, Config::default()),
            (1, other_fused),
            (2, no_fused),
        ] {
            let configs: Vec<Config> = (0..3)
                .map(|r| {
                    if r == odd_one {
                        odd_config.clone()
                    } else {
                        same.clone()
                    }
                })
                .collect();
            let hellos: Vec<Hello> = configs
                .iter()
                .enumerate()
                .map(|(r, c)| Hello {
                    world: 3,
                    ..hello(&format!("host{r}"), c)
                })
                .collect();
            let wires: Vec<Vec<u8>> = hellos.iter().map(Wire::to_wire).collect();
            for (r, own) in hellos.iter().enumerate() {
                let e = check_all(own, &wires).unwrap_err();
                let Error::TuningMismatch { rank, ours, theirs } = &e else {
                    panic!("rank {r}: expected TuningMismatch, got {e}");
                };
                // The odd rank names the first other rank; the others name the odd one.
                let expected = if r == odd_one {
                    usize::from(odd_one == 0)
                } else {
                    odd_one
                };
                assert_eq!(*rank, expected, "rank {r}: {e}");
                assert_ne!(ours, theirs);
                assert!(e.to_string().contains("SYMM_ALLREDUCE_TUNING"), "{e}");
                if odd_one == 0 && r == 0 {
                    assert!(ours.contains("published"), "{e}");
                }
            }
        }
        // The same table loaded on every rank passes.
        let hellos: Vec<Vec<u8>> = (0..3)
            .map(|_| {
                Hello {
                    world: 3,
                    ..hello("h", &same)
                }
                .to_wire()
            })
            .collect();
        let own = Hello::from_wire(&hellos[0]).unwrap();
        assert_eq!(check_all(&own, &hellos).unwrap().len(), 3);
    }
}
