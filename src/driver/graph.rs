//! Stream capture and graph nodes: what the communicator needs to order its calls across
//! eager launches, captures and graph replays (`communicator/order.rs`), and the stream it
//! keeps cudarc's bookkeeping on while a caller's stream is captured (`UncountedStream`). Each function is one
//! or two driver calls; the caller owns the event and the stream.

use cudarc::driver::sys;

use super::check;
use crate::error::{Error, Result};

/// The oldest driver (as `cuDriverGetVersion` reports it) whose capture queries the ordering
/// of calls uses: `cuStreamGetCaptureInfo_v3` came with CUDA 12.3 (driver r545).
pub(crate) const OLDEST_DRIVER: i32 = 12030;

/// The driver's CUDA version, asked once (0 if the driver does not answer).
pub(crate) fn driver_version() -> i32 {
    static VERSION: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *VERSION.get_or_init(|| {
        let mut version: std::ffi::c_int = 0;
        // SAFETY: a valid out-pointer; the call needs no context.
        let code = unsafe { sys::cuDriverGetVersion(&mut version) };
        if code == sys::CUresult::CUDA_SUCCESS {
            version
        } else {
            0
        }
    })
}

/// `Ok` when the driver has the capture queries below; else the typed error (cudarc's loader
/// would panic on the missing function).
pub(crate) fn require_capture_queries(ordinal: usize) -> Result<()> {
    let version = driver_version();
    if version >= OLDEST_DRIVER {
        return Ok(());
    }
    Err(Error::Unsupported {
        ordinal,
        reason: format!(
            "the driver supports CUDA {}.{}; ordering calls across streams and graph captures needs              cuStreamGetCaptureInfo_v3 (CUDA 12.3, driver r545 or newer): update the driver",
            version / 1000,
            (version % 1000) / 10
        ),
    })
}

/// What a stream is doing, as far as capture goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Capture {
    /// Not capturing: work runs when the stream reaches it.
    None,
    /// Capturing into `graph` (capture sequence `id`, unique for the process's lifetime).
    Active { id: u64, graph: sys::CUgraph },
    /// A capture that was invalidated (an illegal operation during it); it can only end.
    Invalidated,
}

/// The capture state of `stream` (one `cuStreamGetCaptureInfo`).
pub(crate) fn capture_of(stream: sys::CUstream) -> Result<Capture> {
    require_capture_queries(0)?;
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: sys::cuuint64_t = 0;
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: `stream` is a live stream of the caller's context (bound to this thread); the
    // out-pointers are valid locals; the dependency outputs are not asked for (null).
    let code = unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream,
            &mut status,
            &mut id,
            &mut graph,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    check(code, "cuStreamGetCaptureInfo")?;
    Ok(match status {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => Capture::None,
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => Capture::Active { id, graph },
        _ => Capture::Invalidated,
    })
}

/// The nodes the next work captured on `stream` would depend on (its capture frontier),
/// copied out (the driver's array is valid only until the next capture call).
pub(crate) fn capture_frontier(stream: sys::CUstream) -> Result<Vec<sys::CUgraphNode>> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut nodes: *const sys::CUgraphNode = std::ptr::null();
    let mut edges: *const sys::CUgraphEdgeData = std::ptr::null();
    let mut count = 0usize;
    // SAFETY: as in `capture_of`; asking for the edge data too means the query is never
    // refused as lossy (programmatic edges carry data).
    let code = unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream,
            &mut status,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut nodes,
            &mut edges,
            &mut count,
        )
    };
    check(code, "cuStreamGetCaptureInfo")?;
    if nodes.is_null() || count == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the driver returned `count` valid node handles at `nodes`, readable until the
    // next capture operation on `stream`; they are copied now.
    Ok(unsafe { std::slice::from_raw_parts(nodes, count) }.to_vec())
}

/// This thread in the relaxed capture mode while the guard lives (the previous mode comes
/// back on drop): a wait for the communicator's work (`Drop`, `close`) must not invalidate a
/// capture that another thread, or this one on another stream, has going in global mode.
pub(crate) struct RelaxedCapture(Option<sys::CUstreamCaptureMode>);

impl RelaxedCapture {
    /// Switches this thread to `CU_STREAM_CAPTURE_MODE_RELAXED`.
    pub(crate) fn enter() -> RelaxedCapture {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: a valid in/out pointer; the call touches only this thread's mode.
        let code = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        RelaxedCapture((code == sys::CUresult::CUDA_SUCCESS).then_some(mode))
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        if let Some(mut mode) = self.0.take() {
            // SAFETY: as in `enter`; this restores the mode `enter` replaced.
            let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        }
    }
}

/// Whether `stream` is one of the driver's implicit streams (the legacy default stream, or
/// the per-thread default stream): one handle that stands for a different stream on each
/// thread, so two calls with the same handle may still be on different streams.
pub(crate) fn is_implicit_stream(stream: sys::CUstream) -> bool {
    matches!(stream as usize, 0..=2)
}

/// Makes `stream`, which is being captured, wait for `event` *when the graph runs*: an
/// event-wait node (the external flag), which at each launch waits for the work the event
/// last recorded before that launch.
pub(crate) fn wait_external(stream: sys::CUstream, event: sys::CUevent) -> Result<()> {
    // SAFETY: a live capturing stream and a live event of the same context.
    let code = unsafe {
        sys::cuStreamWaitEvent(
            stream,
            event,
            sys::CUevent_wait_flags::CU_EVENT_WAIT_EXTERNAL as std::ffi::c_uint,
        )
    };
    check(code, "cuStreamWaitEvent(external)")
}

/// Adds to `graph` (being captured) a node that records `event` after `deps`, outside the
/// capture's frontier: later captured work does not wait for it.
pub(crate) fn add_record_node(
    graph: sys::CUgraph,
    deps: &[sys::CUgraphNode],
    event: sys::CUevent,
) -> Result<sys::CUgraphNode> {
    let mut node: sys::CUgraphNode = std::ptr::null_mut();
    // SAFETY: `graph` is the graph of an active capture (adding nodes is allowed while it is
    // captured); `deps` are nodes of that graph; `event` is live.
    let code = unsafe { sys::cuGraphAddEventRecordNode(&mut node, graph, deps.as_ptr(), deps.len(), event) };
    check(code, "cuGraphAddEventRecordNode")?;
    Ok(node)
}

/// One default (full) edge `from → to` added (`add`) or removed in `graph`.
fn edge(graph: sys::CUgraph, from: sys::CUgraphNode, to: sys::CUgraphNode, add: bool) -> sys::CUresult {
    // SAFETY: `graph` is being captured (edge changes are allowed while it is); `from` and
    // `to` are nodes of it; null edge data means a default (full) dependency.
    unsafe {
        if add {
            sys::cuGraphAddDependencies_v2(graph, &from, &to, std::ptr::null(), 1)
        } else {
            sys::cuGraphRemoveDependencies_v2(graph, &from, &to, std::ptr::null(), 1)
        }
    }
}

/// Moves `node`'s dependencies from `old` to `new` (full edges), all or nothing: when the
/// driver refuses an edge change, the edges changed so far are put back and the error
/// returned. Graphs that hold memory allocation or free nodes (a capture of
/// `cuMemAllocAsync`, as candle's) refuse every removal (`CUDA_ERROR_NOT_SUPPORTED`).
pub(crate) fn move_dependencies(
    graph: sys::CUgraph,
    node: sys::CUgraphNode,
    old: &[sys::CUgraphNode],
    new: &[sys::CUgraphNode],
) -> Result<()> {
    let (code, call) = move_edges(old, new, |from, add| edge(graph, from, node, add));
    check(code, call)
}

/// [`move_dependencies`]'s order of edge changes, over `change(from, add)` (one edge
/// `from → node` added or removed): every `old` edge removed, then every `new` edge added;
/// on the first refusal the changes made so far are undone (best effort: a refused undo
/// leaves the node with fewer edges, which the caller's fallback, a new node after the
/// newest call, covers). The code and the call of the refusal, or success.
fn move_edges<N: Copy>(
    old: &[N],
    new: &[N],
    mut change: impl FnMut(N, bool) -> sys::CUresult,
) -> (sys::CUresult, &'static str) {
    let ok = sys::CUresult::CUDA_SUCCESS;
    for (i, &from) in old.iter().enumerate() {
        let code = change(from, false);
        if code != ok {
            for &back in &old[..i] {
                change(back, true);
            }
            return (code, "cuGraphRemoveDependencies");
        }
    }
    for (i, &from) in new.iter().enumerate() {
        let code = change(from, true);
        if code != ok {
            for &back in &new[..i] {
                change(back, false);
            }
            for &back in old {
                change(back, true);
            }
            return (code, "cuGraphAddDependencies");
        }
    }
    (ok, "")
}

/// A stream made with the driver and wrapped for cudarc as borrowed, destroyed on drop: it
/// does not count as one of cudarc's streams. cudarc switches a context into multi-stream
/// mode (an event on every buffer use from then on) at the first stream it creates, which a
/// library must not do behind the application's back.
#[derive(Debug)]
pub(crate) struct UncountedStream(std::sync::Arc<cudarc::driver::CudaStream>);

impl UncountedStream {
    /// A non-blocking stream of `ctx`.
    pub(crate) fn new(ctx: &std::sync::Arc<cudarc::driver::CudaContext>) -> Result<UncountedStream> {
        use crate::error::CudaResultExt;
        use cudarc::driver::result::stream;
        ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        let raw = stream::create(stream::StreamKind::NonBlocking).during("cuStreamCreate")?;
        // SAFETY: `raw` is a stream of `ctx`, created just now and destroyed only by `Drop`;
        // the wrapper never leaves this value (callers borrow it).
        Ok(UncountedStream(unsafe { ctx.wrap_borrowed_stream(raw) }))
    }

    /// The stream.
    pub(crate) fn stream(&self) -> &std::sync::Arc<cudarc::driver::CudaStream> {
        &self.0
    }
}

impl Drop for UncountedStream {
    fn drop(&mut self) {
        let _ = self.0.context().bind_to_thread();
        // SAFETY: made by `UncountedStream::new` and destroyed once, here; the borrowed wrapper
        // does nothing with it when it drops; work still queued on it completes before the
        // driver releases it.
        let _ = unsafe { cudarc::driver::result::stream::destroy(self.0.cu_stream()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// A node's incoming edges, changed the way the driver would: a removal of an absent edge
    /// or an addition of a present one is refused, and `refuse` refuses one more change.
    fn run(
        edges: &mut BTreeSet<u32>,
        old: &[u32],
        new: &[u32],
        refuse: Option<(u32, bool)>,
    ) -> sys::CUresult {
        move_edges(old, new, |from, add| {
            let refused = refuse == Some((from, add)) || (add == edges.contains(&from));
            if refused {
                return sys::CUresult::CUDA_ERROR_NOT_SUPPORTED;
            }
            if add {
                edges.insert(from);
            } else {
                edges.remove(&from);
            }
            sys::CUresult::CUDA_SUCCESS
        })
        .0
    }

    #[test]
    fn a_move_leaves_exactly_the_new_edges() {
        let mut edges = BTreeSet::from([1, 2]);
        assert_eq!(run(&mut edges, &[1, 2], &[3], None), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(edges, BTreeSet::from([3]));
        // The next call's move starts from what this one left.
        assert_eq!(run(&mut edges, &[3], &[4, 5], None), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(edges, BTreeSet::from([4, 5]));
    }

    #[test]
    fn a_refused_removal_leaves_the_old_edges() {
        // The second removal is refused (a graph with memory nodes refuses the first: also here).
        for refused in [1, 2] {
            let mut edges = BTreeSet::from([1, 2]);
            let code = run(&mut edges, &[1, 2], &[3], Some((refused, false)));
            assert_eq!(code, sys::CUresult::CUDA_ERROR_NOT_SUPPORTED);
            assert_eq!(edges, BTreeSet::from([1, 2]), "refused removal of {refused}");
        }
    }

    #[test]
    fn a_refused_addition_puts_the_old_edges_back() {
        for refused in [3, 4] {
            let mut edges = BTreeSet::from([1, 2]);
            let code = run(&mut edges, &[1, 2], &[3, 4], Some((refused, true)));
            assert_eq!(code, sys::CUresult::CUDA_ERROR_NOT_SUPPORTED);
            assert_eq!(edges, BTreeSet::from([1, 2]), "refused addition of {refused}");
        }
    }
}
