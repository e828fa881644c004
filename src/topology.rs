//! Where the ranks are and how their devices connect: the facts that decide whether the peer
//! kernels may run or the NCCL fallback must take every call.
//!
//! Every rank probes the links from its own device to every peer's (CUDA's
//! `cuDeviceCanAccessPeer` and `cuDeviceGetP2PAttribute`, and NVML for NVLink versus PCIe when
//! `libnvidia-ml.so.1` loads), the rows are all-gathered, and every rank evaluates the same
//! pure [`Topology::decide`] on the same table, so all ranks reach the same verdict.

use cudarc::driver::{sys, CudaContext};

use crate::driver::nvml;
use crate::driver::p2p::{can_access_peer, p2p_attribute, visible_devices};
use crate::wire::{Reader, Writer};

/// How two ranks' devices are connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinkKind {
    /// Both ranks use the same device (virtual ranks, or several processes on one GPU).
    SameDevice,
    /// NVLink (directly or through NVSwitch), as NVML reports it.
    NvLink,
    /// Peer-to-peer over PCIe: CUDA allows access but NVML reports no NVLink.
    Pcie,
    /// Not known: NVML is missing, or the pair is on different hosts.
    Unknown,
}

impl LinkKind {
    fn code(self) -> u8 {
        match self {
            LinkKind::SameDevice => 0,
            LinkKind::NvLink => 1,
            LinkKind::Pcie => 2,
            LinkKind::Unknown => 3,
        }
    }

    fn from_code(c: u8) -> LinkKind {
        match c {
            0 => LinkKind::SameDevice,
            1 => LinkKind::NvLink,
            2 => LinkKind::Pcie,
            _ => LinkKind::Unknown,
        }
    }
}

impl std::fmt::Display for LinkKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LinkKind::SameDevice => "same device",
            LinkKind::NvLink => "NVLink",
            LinkKind::Pcie => "PCIe",
            LinkKind::Unknown => "unknown link",
        })
    }
}

/// Where one rank runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPlacement {
    /// Host name (for messages).
    pub host: String,
    /// Identity of the host's running kernel (`/proc/sys/kernel/random/boot_id`): equal
    /// exactly when two processes can share memory handles.
    pub host_id: [u8; 16],
    /// The device's UUID.
    pub device_uuid: [u8; 16],
    /// The device's ordinal in that rank's process (after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: usize,
}

/// What rank `from` found about the path from its device to rank `to`'s device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerLink {
    /// The probing rank.
    pub from: usize,
    /// The peer rank.
    pub to: usize,
    /// Whether `from`'s device can access `to`'s device memory (`None`: could not be checked,
    /// e.g. the peer's device is not visible to this process and NVML is missing).
    pub access: Option<bool>,
    /// Whether atomics on peer memory are native (CUDA's P2P attribute).
    pub native_atomics: Option<bool>,
    /// CUDA's relative performance rank of the link (lower is better).
    pub performance_rank: Option<i32>,
    /// NVLink, PCIe, same device, or unknown.
    pub link: LinkKind,
}

/// Placement of every rank and every probed link.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Topology {
    /// Indexed by rank.
    pub ranks: Vec<RankPlacement>,
    /// Each rank's view of each peer (`from != to`).
    pub links: Vec<PeerLink>,
}

/// Whether the peer kernels may run, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerDecision {
    /// `true`: the symmetric workspace is set up and the peer kernels are used.
    pub allowed: bool,
    /// One sentence naming the deciding fact.
    pub reason: String,
}

impl Topology {
    /// The verdict, a pure function of the table (every rank computes the same):
    /// - ranks on several hosts: not allowed (memory handles do not cross hosts);
    /// - any pair whose access is known to be impossible: not allowed;
    /// - more than two ranks with any PCIe-only pair: not allowed (over PCIe the peer kernels
    ///   do not beat NCCL beyond two ranks, the rule vLLM's custom all-reduce also uses);
    /// - otherwise allowed; pairs whose access could not be checked are left to the mapping
    ///   step, whose vote catches a failure.
    pub fn decide(&self) -> PeerDecision {
        let world = self.ranks.len();
        let deny = |reason: String| PeerDecision {
            allowed: false,
            reason,
        };
        let mut hosts: Vec<(&[u8; 16], &str, Vec<usize>)> = Vec::new();
        for (r, p) in self.ranks.iter().enumerate() {
            match hosts.iter_mut().find(|(id, _, _)| **id == p.host_id) {
                Some((_, _, ranks)) => ranks.push(r),
                None => hosts.push((&p.host_id, &p.host, vec![r])),
            }
        }
        if hosts.len() > 1 {
            let list: Vec<String> = hosts
                .iter()
                .map(|(_, name, ranks)| format!("{name}: ranks {ranks:?}"))
                .collect();
            return deny(format!(
                "the ranks span {} hosts ({}): device memory cannot be mapped across hosts",
                hosts.len(),
                list.join("; ")
            ));
        }
        let device = |r: usize| self.ranks.get(r).map_or(usize::MAX, |p| p.ordinal);
        if let Some(l) = self
            .links
            .iter()
            .find(|l| l.link != LinkKind::SameDevice && l.access == Some(false))
        {
            return deny(format!(
                "rank {} (device {}) cannot access rank {}'s device {} peer-to-peer",
                l.from,
                device(l.from),
                l.to,
                device(l.to)
            ));
        }
        if world > 2 {
            if let Some(l) = self.links.iter().find(|l| l.link == LinkKind::Pcie) {
                return deny(format!(
                    "ranks {} and {} are connected over PCIe only, and with more than two ranks NCCL wins over PCIe",
                    l.from, l.to
                ));
            }
        }
        let distinct: Vec<&PeerLink> = self
            .links
            .iter()
            .filter(|l| l.link != LinkKind::SameDevice)
            .collect();
        let count = |k: LinkKind| distinct.iter().filter(|l| l.link == k).count();
        let unchecked = distinct.iter().filter(|l| l.access.is_none()).count();
        let reason = if world <= 1 {
            "one rank".to_string()
        } else if distinct.is_empty() {
            format!("all {world} ranks share one device")
        } else if count(LinkKind::NvLink) == distinct.len() {
            "every pair of devices is connected by NVLink".to_string()
        } else if unchecked > 0 {
            format!(
                "peer access could not be checked for {unchecked} of {} links (the peer's device is not visible to \
                 this process): the mapping step decides",
                distinct.len()
            )
        } else {
            format!(
                "peer access verified for every pair ({} NVLink, {} PCIe, {} of unknown kind)",
                count(LinkKind::NvLink),
                count(LinkKind::Pcie),
                count(LinkKind::Unknown)
            )
        };
        PeerDecision {
            allowed: true,
            reason,
        }
    }

    /// A few lines: every rank's placement, every link, and the verdict.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        for (r, p) in self.ranks.iter().enumerate() {
            s += &format!(
                "rank {r}: device {} ({}) on {}\n",
                p.ordinal,
                nvml::nvml_uuid_string(&p.device_uuid),
                p.host
            );
        }
        let yes_no = |v: Option<bool>| match v {
            Some(true) => "yes",
            Some(false) => "no",
            None => "unknown",
        };
        for l in &self.links {
            s += &format!(
                "rank {} -> rank {}: {}, peer access {}, native atomics {}, performance rank {}\n",
                l.from,
                l.to,
                l.link,
                yes_no(l.access),
                yes_no(l.native_atomics),
                l.performance_rank.map_or("unknown".into(), |p| p.to_string())
            );
        }
        let d = self.decide();
        s += &format!(
            "peer kernels {}: {}",
            if d.allowed { "allowed" } else { "not allowed" },
            d.reason
        );
        s
    }
}

// ---- Wire format (one rank's row) ----------------------------------------------------------

const LINK_BYTES: usize = 12;

/// `Option<bool>` as one byte: 0, 1, or 0xff for unknown.
fn tri(v: Option<bool>) -> u8 {
    match v {
        None => 0xff,
        Some(b) => b as u8,
    }
}

fn untri(v: u8) -> Option<bool> {
    match v {
        0 => Some(false),
        1 => Some(true),
        _ => None,
    }
}

/// Encodes one rank's links for the all-gather: per link `from: u8 | to: u8 | access: u8 |
/// native atomics: u8 | performance rank: i32 (i32::MIN: unknown) | link kind: u8 | 3 zero
/// bytes`.
pub(crate) fn encode_links(links: &[PeerLink]) -> Vec<u8> {
    let mut w = Writer::with_capacity(links.len() * LINK_BYTES);
    for l in links {
        w.put(&(l.from as u8))
            .put(&(l.to as u8))
            .put(&tri(l.access))
            .put(&tri(l.native_atomics))
            .put(&(l.performance_rank.unwrap_or(i32::MIN) as u32))
            .put(&l.link.code())
            .put(&[0u8; 3]);
    }
    w.finish()
}

pub(crate) fn decode_links(b: &[u8], world: usize) -> Result<Vec<PeerLink>, String> {
    if b.len() % LINK_BYTES != 0 {
        return Err("malformed topology row (mismatched crate versions?)".into());
    }
    let mut r = Reader::new(b);
    let mut links = Vec::with_capacity(b.len() / LINK_BYTES);
    while !r.is_empty() {
        let malformed = || "malformed topology row".to_string();
        let (from, to) = (
            r.take::<u8>().ok_or_else(malformed)? as usize,
            r.take::<u8>().ok_or_else(malformed)? as usize,
        );
        if from >= world || to >= world {
            return Err(format!(
                "topology row names rank {from} -> {to} in a world of {world}"
            ));
        }
        let access = untri(r.take().ok_or_else(malformed)?);
        let native_atomics = untri(r.take().ok_or_else(malformed)?);
        let perf = r.take::<u32>().ok_or_else(malformed)? as i32;
        let link = LinkKind::from_code(r.take().ok_or_else(malformed)?);
        r.take::<[u8; 3]>().ok_or_else(malformed)?;
        links.push(PeerLink {
            from,
            to,
            access,
            native_atomics,
            performance_rank: (perf != i32::MIN).then_some(perf),
            link,
        });
    }
    Ok(links)
}

// ---- Probing -------------------------------------------------------------------------------

/// This host's name and identity.
pub(crate) fn this_host() -> (String, [u8; 16]) {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown-host".into());
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let hexits: Vec<u8> = boot
        .trim()
        .chars()
        .filter_map(|c| c.to_digit(16).map(|d| d as u8))
        .collect();
    let mut id = [0u8; 16];
    if hexits.len() == 32 {
        for (i, pair) in hexits.chunks(2).enumerate() {
            id[i] = pair[0] << 4 | pair[1];
        }
    } else {
        // No boot id: fall back to the host name (FNV-1a, spread over 16 bytes).
        let h = crate::digest::fnv1a(host.bytes());
        id[..8].copy_from_slice(&h.to_le_bytes());
        id[8..].copy_from_slice(&h.rotate_left(29).to_le_bytes());
    }
    (host, id)
}

/// Probes the links from `rank`'s device (`ctx`) to every peer. Never fails: anything that
/// cannot be asked stays `None`/`Unknown`.
pub(crate) fn probe_links(ctx: &CudaContext, rank: usize, ranks: &[RankPlacement]) -> Vec<PeerLink> {
    let me = &ranks[rank];
    let visible = visible_devices();
    ranks
        .iter()
        .enumerate()
        .filter(|(q, _)| *q != rank)
        .map(|(q, peer)| {
            let mut link = PeerLink {
                from: rank,
                to: q,
                access: None,
                native_atomics: None,
                performance_rank: None,
                link: LinkKind::Unknown,
            };
            if peer.host_id != me.host_id {
                return link;
            }
            if peer.device_uuid == me.device_uuid {
                link.access = Some(true);
                link.native_atomics = Some(true);
                link.link = LinkKind::SameDevice;
                return link;
            }
            let pair = nvml::pair(&me.device_uuid, &peer.device_uuid);
            let nvml_kind = match pair.nvlink {
                Some(true) => LinkKind::NvLink,
                Some(false) => LinkKind::Pcie,
                None => LinkKind::Unknown,
            };
            if let Some(&(_, dev)) = visible.iter().find(|(uuid, _)| *uuid == peer.device_uuid) {
                let attr = |a| p2p_attribute(ctx.cu_device(), dev, a);
                link.access = attr(sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED)
                    .map(|v| v != 0);
                link.native_atomics =
                    attr(sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)
                        .map(|v| v != 0);
                link.performance_rank =
                    attr(sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK);
                if link.access == Some(true) && !can_access_peer(ctx.cu_device(), dev) {
                    link.access = Some(false);
                }
            } else {
                link.access = pair.access;
            }
            link.link = match (nvml_kind, link.access) {
                (LinkKind::NvLink, _) => LinkKind::NvLink,
                (LinkKind::Pcie, Some(true)) => LinkKind::Pcie,
                _ => LinkKind::Unknown,
            };
            link
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place(host: u8, device: u8) -> RankPlacement {
        RankPlacement {
            host: format!("host{host}"),
            host_id: [host; 16],
            device_uuid: [device; 16],
            ordinal: device as usize,
        }
    }

    fn link(from: usize, to: usize, access: Option<bool>, kind: LinkKind) -> PeerLink {
        PeerLink {
            from,
            to,
            access,
            native_atomics: access,
            performance_rank: Some(0),
            link: kind,
        }
    }

    fn full(ranks: Vec<RankPlacement>, access: Option<bool>, kind: LinkKind) -> Topology {
        let world = ranks.len();
        let mut links = Vec::new();
        for a in 0..world {
            for b in 0..world {
                if a != b {
                    let k = if ranks[a].device_uuid == ranks[b].device_uuid {
                        LinkKind::SameDevice
                    } else {
                        kind
                    };
                    links.push(link(a, b, access, k));
                }
            }
        }
        Topology { ranks, links }
    }

    #[test]
    fn nvlink_everywhere_and_shared_devices_are_allowed() {
        let t = full(
            (0..8).map(|d| place(1, d)).collect(),
            Some(true),
            LinkKind::NvLink,
        );
        let d = t.decide();
        assert!(d.allowed && d.reason.contains("NVLink"), "{d:?}");
        let t = full((0..4).map(|_| place(1, 0)).collect(), None, LinkKind::Unknown);
        let d = t.decide();
        assert!(d.allowed && d.reason.contains("share one device"), "{d:?}");
        assert!(full(vec![place(1, 0)], None, LinkKind::Unknown).decide().allowed);
    }

    #[test]
    fn several_hosts_are_not_allowed() {
        let t = full(
            vec![place(1, 0), place(1, 1), place(2, 0)],
            Some(true),
            LinkKind::NvLink,
        );
        let d = t.decide();
        assert!(!d.allowed);
        assert!(
            d.reason.contains("2 hosts") && d.reason.contains("host2: ranks [2]"),
            "{d:?}"
        );
    }

    #[test]
    fn a_pair_without_peer_access_is_not_allowed() {
        let mut t = full((0..2).map(|d| place(1, d)).collect(), Some(true), LinkKind::Pcie);
        assert!(t.decide().allowed, "two ranks over PCIe are allowed");
        t.links[1].access = Some(false);
        let d = t.decide();
        assert!(
            !d.allowed && d.reason.contains("rank 1 (device 1) cannot access rank 0"),
            "{d:?}"
        );
    }

    #[test]
    fn pcie_beyond_two_ranks_goes_to_nccl() {
        let mut t = full(
            (0..4).map(|d| place(1, d)).collect(),
            Some(true),
            LinkKind::NvLink,
        );
        assert!(t.decide().allowed);
        t.links[5].link = LinkKind::Pcie;
        let d = t.decide();
        assert!(!d.allowed && d.reason.contains("PCIe"), "{d:?}");
    }

    #[test]
    fn unknown_access_is_left_to_the_mapping_vote() {
        let t = full((0..2).map(|d| place(1, d)).collect(), None, LinkKind::Unknown);
        let d = t.decide();
        assert!(d.allowed && d.reason.contains("mapping step"), "{d:?}");
        let t = full(
            (0..2).map(|d| place(1, d)).collect(),
            Some(true),
            LinkKind::Unknown,
        );
        assert!(t.decide().reason.contains("verified"));
    }

    #[test]
    fn links_round_trip_and_summary_names_everything() {
        let t = full(
            (0..3).map(|d| place(1, d)).collect(),
            Some(true),
            LinkKind::NvLink,
        );
        let mut links = t.links.clone();
        links[0].performance_rank = None;
        links[1].access = None;
        links[2].link = LinkKind::Unknown;
        assert_eq!(decode_links(&encode_links(&links), 3).unwrap(), links);
        assert!(decode_links(&encode_links(&links), 2).is_err());
        assert!(decode_links(&[0; 5], 3).is_err());
        let s = t.summary();
        assert!(s.contains("rank 2: device 2 (GPU-02020202-0202"), "{s}");
        assert!(s.contains("rank 0 -> rank 1: NVLink, peer access yes"), "{s}");
        assert!(
            s.ends_with("peer kernels allowed: every pair of devices is connected by NVLink"),
            "{s}"
        );
    }

    #[test]
    fn host_identity_is_stable() {
        let (name, id) = this_host();
        assert!(!name.is_empty());
        assert_eq!(this_host().1, id);
    }
}
