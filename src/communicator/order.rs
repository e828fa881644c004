//! One order for every call of a rank, whatever mix of streams, captures and graph replays
//! they come in: two kernels of one communicator never run at once, and they run in the
//! order the calls were made (eager calls) or the graphs were launched (captured calls).
//!
//! Why it matters: a kernel takes its epoch from the call state in device memory when it
//! starts. Two kernels of one rank running at once would take the same epoch, and the ranks
//! would pair different calls.
//!
//! The mechanism is one event per communicator, `serial`, that always marks the end of the
//! communicator's most recently *enqueued* call:
//! - An eager call waits for `serial` on its stream and records it after its launch.
//! - A captured call puts the same into its graph: the first call of a capture adds an
//!   event-wait node for `serial` in front of it (the external flag: the wait happens at each
//!   launch of the graph, for whatever `serial` marks then), and one record node of `serial`
//!   hangs off the capture's newest call: each later call of the capture moves its edges to
//!   itself, so it always follows the graph's last call of this communicator. Later calls of
//!   the same capture are ordered after the first by the capture itself. The record node is
//!   off the capture's frontier, so consecutive calls in a graph stay adjacent kernel nodes,
//!   and only the last call has a second successor: a kernel node with a second successor
//!   loses Programmatic Dependent Launch to the next kernel (measured: about 2 µs per call
//!   in a chain of calls on one H100). A graph that holds memory allocation nodes (a capture
//!   of `cuMemAllocAsync`, as candle's) refuses edge removal; there each call adds a record
//!   node after itself and after the previous one (a chain: the last to run follows the
//!   graph's last call), which keeps the order and costs that gap.
//! - Every eager call records `serial` after its launch (never on a capturing stream: an
//!   event recorded inside a capture cannot be waited for eagerly later, which is what broke
//!   a capture on the same stream as the eager calls before it). Until the first capture an
//!   eager call waits for `serial` only when it comes on another stream than the previous
//!   call.
//!
//! This is what NCCL does for its calls mixed with graphs (`NCCL_GRAPH_MIXING_SUPPORT`),
//! except that NCCL chains a record node after every captured call.

use std::sync::Arc;

use cudarc::driver::{sys, CudaEvent, CudaStream};

use crate::driver::graph::{self, Capture};
use crate::error::{Error, Result};

/// The ordering state of one communicator (behind its mutex: one call at a time).
#[derive(Debug)]
pub(super) struct StreamOrder {
    /// The stream of the last eager call.
    last: Option<Arc<CudaStream>>,
    /// Marks the end of the most recently enqueued call.
    serial: CudaEvent,
    /// Joins two streams of one capture.
    scratch: CudaEvent,
    /// Set by the first captured call: from then on every eager call waits for `serial`.
    mixing: bool,
    /// The captures in progress that hold calls of this communicator.
    captures: Vec<CaptureTail>,
}

/// The last call of one capture in progress and the record node that follows it.
#[derive(Debug)]
struct CaptureTail {
    id: u64,
    graph: GraphHandles,
    stream: Arc<CudaStream>,
    record: NodeHandle,
    /// The nodes `record` depends on while it is moved along; `None` once the graph refused
    /// an edge removal and record nodes are chained instead.
    after: Option<Vec<NodeHandle>>,
}

/// A graph handle kept between calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct GraphHandles(sys::CUgraph);
/// A graph node handle kept between calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct NodeHandle(sys::CUgraphNode);

// SAFETY: graph and node handles are opaque driver handles, valid on any thread that has the
// context current (every use binds it first); the communicator's mutex serialises their use.
unsafe impl Send for GraphHandles {}
// SAFETY: as above.
unsafe impl Send for NodeHandle {}

impl StreamOrder {
    pub(super) fn new(serial: CudaEvent, scratch: CudaEvent) -> StreamOrder {
        StreamOrder {
            last: None,
            serial,
            scratch,
            mixing: false,
            captures: Vec::new(),
        }
    }

    /// Runs `launch` (which enqueues exactly one call of the communicator on `stream`) in the
    /// communicator's order. The context is bound to this thread.
    pub(super) fn run(
        &mut self,
        stream: &Arc<CudaStream>,
        launch: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        match graph::capture_of(stream.cu_stream())? {
            Capture::None => self.eager(stream, launch),
            Capture::Active { id, graph } => self.captured(stream, id, GraphHandles(graph), launch),
            // The capture is already broken: the launch reports it (CUDA refuses it).
            Capture::Invalidated => launch(),
        }
    }

    fn eager(&mut self, stream: &Arc<CudaStream>, launch: impl FnOnce() -> Result<()>) -> Result<()> {
        let order = |e: cudarc::driver::DriverError| Error::StreamOrder { source: e };
        // The implicit streams' handles name another stream on each thread: always a switch.
        let switched = self.last.as_ref().is_some_and(|l| {
            l.cu_stream() != stream.cu_stream() || graph::is_implicit_stream(stream.cu_stream())
        });
        if self.mixing || switched {
            stream.wait(&self.serial).map_err(order)?;
        }
        launch()?;
        self.serial.record(stream).map_err(order)?;
        self.last = Some(stream.clone());
        Ok(())
    }

    fn captured(
        &mut self,
        stream: &Arc<CudaStream>,
        id: u64,
        graph: GraphHandles,
        launch: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        self.forget_ended_captures()?;
        let order = |e: cudarc::driver::DriverError| Error::StreamOrder { source: e };
        if let Some(tail) = self.captures.iter_mut().find(|t| t.id == id) {
            if tail.stream.cu_stream() != stream.cu_stream() {
                // Another stream of the same capture: after the previous call in the graph.
                self.scratch.record(&tail.stream).map_err(order)?;
                stream.wait(&self.scratch).map_err(order)?;
            }
            launch()?;
            let after = graph::capture_frontier(stream.cu_stream())?;
            tail.stream = stream.clone();
            if let Some(old) = &tail.after {
                let old: Vec<_> = old.iter().map(|n| n.0).collect();
                if graph::move_dependencies(graph.0, tail.record.0, &old, &after).is_ok() {
                    tail.after = Some(after.into_iter().map(NodeHandle).collect());
                    return Ok(());
                }
                // Refused (memory nodes in the graph): chain from now on.
                tail.after = None;
            }
            let mut deps = after;
            deps.push(tail.record.0);
            tail.record = NodeHandle(graph::add_record_node(graph.0, &deps, self.serial.cu_event())?);
            return Ok(());
        }
        // From now on every eager call waits for `serial` too (a replay may come between).
        self.mixing = true;
        graph::wait_external(stream.cu_stream(), self.serial.cu_event())?;
        launch()?;
        let after = graph::capture_frontier(stream.cu_stream())?;
        let record = graph::add_record_node(graph.0, &after, self.serial.cu_event())?;
        self.captures.push(CaptureTail {
            id,
            graph,
            stream: stream.clone(),
            record: NodeHandle(record),
            after: Some(after.into_iter().map(NodeHandle).collect()),
        });
        Ok(())
    }

    /// Drops the tails of captures that have ended (their stream no longer captures under
    /// the same id): their graphs belong to the application now.
    fn forget_ended_captures(&mut self) -> Result<()> {
        let mut i = 0;
        while i < self.captures.len() {
            let tail = &self.captures[i];
            let ongoing = matches!(
                graph::capture_of(tail.stream.cu_stream())?,
                Capture::Active { id, graph } if id == tail.id && GraphHandles(graph) == tail.graph
            );
            if ongoing {
                i += 1;
            } else {
                self.captures.swap_remove(i);
            }
        }
        Ok(())
    }

    /// Waits until every call enqueued so far (eager, or in a graph launched so far) has
    /// completed: `serial` marks the last of them (every eager call records it, and every
    /// launched graph's record nodes). In the relaxed capture mode, so that a drop or close
    /// while a capture is going on (a garbage-collected communicator inside
    /// `torch.cuda.graph`, say) does not invalidate that capture.
    pub(super) fn wait_for_all(&mut self) -> std::result::Result<(), cudarc::driver::DriverError> {
        let _relaxed = graph::RelaxedCapture::enter();
        self.last = None;
        self.serial.synchronize()
    }
}
