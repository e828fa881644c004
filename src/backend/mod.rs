//! The data paths a routed call runs on: the peer kernels over the symmetric workspace
//! ([`peer`]) and NCCL ([`nccl`]). Each takes validated addresses and launches; neither
//! decides anything.

pub(crate) mod nccl;
pub(crate) mod peer;
