// The interface between the device code and the Rust side (src/kernels/abi.rs): the kernel
// argument block and the constants both sides size their arrays by. Each constant stands on
// a line of its own as `constexpr <type> NAME = <value>;`: a Rust test reads them from this
// file and compares them with its own, and the static_asserts below pin the layout here.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace symm {

// Mirrors `SymmArgs` in src/kernels/abi.rs field for field (both are plain C layouts).
struct SymmArgs {
    // This rank's virtual address of rank 0's allocation; rank q's allocation is mapped at
    // base + q * stride in every rank's address space (one contiguous reservation per rank).
    uint64_t base;
    uint64_t stride;
    uint64_t signal_offset;  // signal pad: [phase][block][32 slots] of u32, one 128-byte row per block
    uint64_t state_offset;   // this rank's CallState (only the owner touches it)
    uint64_t data_offset;    // two data buffers (parity 0 and 1) of data_bytes each, then the
    uint64_t data_bytes;     // user-visible symmetric buffer (data_bytes) at data_offset + 2*data_bytes
    uint64_t ll_offset;      // low-latency slots: [parity 2][source rank world] of ll_slot_bytes
    uint64_t ll_slot_bytes;  // 16-byte lines, each carrying 8 payload bytes and the epoch twice
    uint64_t error;          // host-mapped u32: 0, or an error code written by a timed-out wait
    uint64_t timeout_ns;     // bound on every wait
    uint32_t rank;
    uint32_t world;
    // Zero-copy pool calls: a digest of the buffer's allocation (sequence number, offset,
    // bytes, dtype) and of the call (view offset, length), the same on every rank when every
    // rank made the same sequence of allocations (0 for the legacy symmetric buffer). The
    // zero-copy kernel publishes it and compares it with every peer's before touching any data
    // (kernels/pool.cuh). The other kernels ignore it.
    uint64_t pool_tag;
};

static_assert(sizeof(SymmArgs) == 96, "SymmArgs: ten u64, two u32, then pool_tag, as in src/kernels/abi.rs");
static_assert(alignof(SymmArgs) == 8, "SymmArgs is 8-aligned");
static_assert(offsetof(SymmArgs, ll_offset) == 48, "SymmArgs::ll_offset");
static_assert(offsetof(SymmArgs, error) == 64, "SymmArgs::error");
static_assert(offsetof(SymmArgs, timeout_ns) == 72, "SymmArgs::timeout_ns");
static_assert(offsetof(SymmArgs, rank) == 80, "SymmArgs::rank");
static_assert(offsetof(SymmArgs, world) == 84, "SymmArgs::world");
static_assert(offsetof(SymmArgs, pool_tag) == 88, "SymmArgs::pool_tag");

constexpr uint32_t MAX_RANKS = 8;
constexpr uint32_t MAX_BLOCKS = 64;
constexpr uint32_t SLOTS_PER_ROW = 32;
constexpr uint32_t THREADS = 512;

// Error word layout (decoded by src/kernels/abi.rs): kind | phase << 8 | peer << 16.
constexpr uint32_t ERROR_PEER_TIMEOUT = 1;
// A zero-copy pool call whose pool tag differs between ranks (peer: the first rank whose tag
// differs from this rank's): the ranks' allocation sequences diverged.
constexpr uint32_t ERROR_POOL_MISMATCH = 2;
// The last POOL_TAG_BYTES of every rank's allocation hold the pool tags, [parity 2] of u64.
constexpr uint32_t POOL_TAG_BYTES = 256;

// Barrier phases, as reported in the error word (src/error.rs BarrierPhase).
enum Phase : uint32_t { PHASE_START = 0, PHASE_MIDDLE = 1, PHASE_END = 2, PHASE_ARRIVAL = 3 };

// Call bookkeeping in device memory, advanced by the kernels themselves: no host state per
// call, so a captured graph replays correctly any number of times.
struct CallState {
    uint32_t calls;     // completed calls; the running call's epoch is calls + 1
    uint32_t finished;  // blocks of the running call that have finished
};

}  // namespace symm
