//! A bootstrap over an existing NCCL communicator: bytes are all-gathered through device
//! memory in fixed-size, length-prefixed frames; descriptors take the trait's default
//! exchange over per-rank abstract `AF_UNIX` sockets whose names travel through NCCL.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;
use cudarc::nccl::Comm;

use super::Bootstrap;
use crate::error::{CudaResultExt, Error, Result};
use crate::wire::{Reader, Writer};

/// Bytes per all-gather frame.
pub(crate) const FRAME: usize = 1024;
/// Payload bytes in the first frame (after the 4-byte length).
const FIRST_PAYLOAD: usize = FRAME - 4;
/// Largest message one rank may contribute.
const MAX_MESSAGE: usize = 16 << 20;

/// Frames a message of `len` bytes takes.
pub(crate) fn frames_needed(len: usize) -> usize {
    1 + len.saturating_sub(FIRST_PAYLOAD).div_ceil(FRAME)
}

/// The first frame: `length: u32` then the first bytes, zero-padded.
pub(crate) fn first_frame(bytes: &[u8]) -> Vec<u8> {
    let n = bytes.len().min(FIRST_PAYLOAD);
    let mut w = Writer::with_capacity(FRAME);
    w.put(&(bytes.len() as u32))
        .raw(&bytes[..n])
        .raw(&[0; FIRST_PAYLOAD][n..]);
    w.finish()
}

/// `extra` continuation frames: the bytes after the first frame's, zero-padded.
pub(crate) fn continuation_frames(bytes: &[u8], extra: usize) -> Vec<u8> {
    let mut f = vec![0u8; extra * FRAME];
    let rest = bytes.get(FIRST_PAYLOAD..).unwrap_or_default();
    f[..rest.len()].copy_from_slice(rest);
    f
}

/// Every rank's length from the gathered first frames.
pub(crate) fn frame_lengths(first: &[u8], world: usize) -> std::result::Result<Vec<usize>, String> {
    if first.len() != world * FRAME {
        return Err(format!(
            "gathered {} bytes, expected {}",
            first.len(),
            world * FRAME
        ));
    }
    (0..world)
        .map(|q| {
            let len = Reader::new(&first[q * FRAME..]).take::<u32>().unwrap_or(u32::MAX) as usize;
            if len > MAX_MESSAGE {
                Err(format!(
                    "rank {q} announced a {len}-byte message (over {MAX_MESSAGE}): malformed"
                ))
            } else {
                Ok(len)
            }
        })
        .collect()
}

/// Rebuilds every rank's message from the first frames and `extra` continuation frames per
/// rank.
pub(crate) fn assemble(first: &[u8], rest: &[u8], lengths: &[usize], extra: usize) -> Vec<Vec<u8>> {
    lengths
        .iter()
        .enumerate()
        .map(|(q, &len)| {
            let head = len.min(FIRST_PAYLOAD);
            let mut m = first[q * FRAME + 4..q * FRAME + 4 + head].to_vec();
            if len > head {
                let at = q * extra * FRAME;
                m.extend_from_slice(&rest[at..at + (len - head)]);
            }
            m
        })
        .collect()
}

/// A [`Bootstrap`] over an existing cudarc NCCL communicator: bytes are all-gathered through
/// device memory on the communicator's stream (every wait bounded by `timeout`), descriptors
/// over per-rank abstract Unix sockets whose names travel through NCCL. Needs every rank on
/// one host for the descriptors; [`crate::Communicator::from_nccl`] checks that first and
/// otherwise never asks for descriptors.
pub struct NcclBootstrap<'a> {
    comm: &'a Comm,
    timeout: Duration,
}

impl std::fmt::Debug for NcclBootstrap<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclBootstrap(rank {} of {}, timeout {:?})",
            self.comm.rank(),
            self.comm.world_size(),
            self.timeout
        )
    }
}

impl<'a> NcclBootstrap<'a> {
    /// Uses `comm` (which must stay unused by anyone else meanwhile). Every exchange gives up
    /// after `timeout`.
    pub fn new(comm: &'a Comm, timeout: Duration) -> Self {
        NcclBootstrap { comm, timeout }
    }

    /// One `ncclAllGather` of `local` (the same length on every rank), bounded by the timeout.
    fn gather_device(&self, local: &[u8]) -> Result<Vec<u8>> {
        let world = self.comm.world_size();
        let stream = self.comm.stream();
        stream.context().bind_to_thread().during("cuCtxSetCurrent")?;
        let send = stream.clone_htod(local).during("cuMemcpyHtoDAsync")?;
        let mut recv = stream
            .alloc_zeros::<u8>(local.len() * world)
            .during("cuMemAllocAsync")?;
        self.comm
            .all_gather(&send, &mut recv)
            .map_err(Error::from_cudarc_nccl("ncclAllGather"))?;
        wait_bounded(&stream, self.timeout, self.comm.rank())?;
        stream.clone_dtoh(&recv).during("cuMemcpyDtoH")
    }
}

/// Waits for `stream` by polling an event until `timeout`.
fn wait_bounded(stream: &Arc<CudaStream>, timeout: Duration, rank: usize) -> Result<()> {
    let event = stream.context().new_event(None).during("cuEventCreate")?;
    event.record(stream).during("cuEventRecord")?;
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_micros(20);
    loop {
        if event.try_is_complete().during("cuEventQuery")? {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(Error::PeerSetupFailed {
                step: "NCCL bootstrap",
                rank: Some(rank),
                reason: format!(
                    "an ncclAllGather did not complete within {timeout:?}: a rank died or is at another setup step"
                ),
            });
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(1));
    }
}

impl Bootstrap for NcclBootstrap<'_> {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world(&self) -> usize {
        self.comm.world_size()
    }

    fn all_gather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let world = self.world();
        if bytes.len() > MAX_MESSAGE {
            return Err(Error::Bootstrap {
                reason: format!(
                    "a {}-byte setup message is over the {MAX_MESSAGE}-byte limit",
                    bytes.len()
                ),
            });
        }
        let malformed = |reason: String| Error::PeerSetupFailed {
            step: "NCCL bootstrap",
            rank: None,
            reason,
        };
        let first = self.gather_device(&first_frame(bytes))?;
        let lengths = frame_lengths(&first, world).map_err(malformed)?;
        // Every rank sees the same lengths, so every rank makes the same second call (or none).
        let extra = lengths.iter().map(|&l| frames_needed(l)).max().unwrap_or(1) - 1;
        let rest = if extra > 0 {
            self.gather_device(&continuation_frames(bytes, extra))?
        } else {
            Vec::new()
        };
        Ok(assemble(&first, &rest, &lengths, extra))
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_any_lengths() {
        let lengths = [
            0usize,
            1,
            FIRST_PAYLOAD - 1,
            FIRST_PAYLOAD,
            FIRST_PAYLOAD + 1,
            5000,
            3 * FRAME,
        ];
        let messages: Vec<Vec<u8>> = lengths
            .iter()
            .enumerate()
            .map(|(q, &n)| (0..n).map(|i| (i * 7 + q) as u8).collect())
            .collect();
        let world = messages.len();
        // What the all-gathers would return: concatenation in rank order.
        let first: Vec<u8> = messages.iter().flat_map(|m| first_frame(m)).collect();
        let got = frame_lengths(&first, world).unwrap();
        assert_eq!(got, lengths);
        let extra = got.iter().map(|&l| frames_needed(l)).max().unwrap() - 1;
        assert_eq!(extra, frames_needed(5000) - 1); // the longest message decides
        let rest: Vec<u8> = messages
            .iter()
            .flat_map(|m| continuation_frames(m, extra))
            .collect();
        assert_eq!(rest.len(), world * extra * FRAME);
        assert_eq!(assemble(&first, &rest, &got, extra), messages);
    }

    #[test]
    fn frame_counts_and_bad_lengths() {
        assert_eq!(frames_needed(0), 1);
        assert_eq!(frames_needed(FIRST_PAYLOAD), 1);
        assert_eq!(frames_needed(FIRST_PAYLOAD + 1), 2);
        assert_eq!(frames_needed(FIRST_PAYLOAD + FRAME), 2);
        assert_eq!(frames_needed(FIRST_PAYLOAD + FRAME + 1), 3);
        let mut f = first_frame(b"abc");
        f[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(frame_lengths(&f, 1).is_err());
        assert!(frame_lengths(&f, 2).is_err());
    }
}
