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
    uint64_t signal_offset;  // signal pad: [phase][block][16 slots] of u64, one 128-byte row per block
    uint64_t state_offset;   // this rank's CallState (only the owner touches it)
    uint64_t data_offset;    // two data buffers (parity 0 and 1) of data_bytes each, then the
    uint64_t data_bytes;     // user-visible symmetric buffer (data_bytes) at data_offset + 2*data_bytes
    uint64_t ll_offset;      // low-latency slots: [buffer 3][source rank world] of ll_slot_bytes
    uint64_t ll_slot_bytes;  // 16-byte lines of 16 payload bytes; all-ones = not yet arrived
    uint64_t error;          // host-mapped u32: 0, or the error code that stopped this rank
    uint64_t timeout_ns;     // bound on every wait
    uint32_t rank;
    uint32_t world;
    // Divergence check (0: off): this call's shape, kind << 24 | dtype << 16 | algorithm << 8 | 1,
    // and its length; exchanged with every peer before any data is touched.
    uint64_t check_shape;
    uint64_t check_len;
    // Zero-copy pool calls: a digest of the buffer's allocation (sequence number, offset,
    // bytes, dtype) and of the call (view offset, length), the same on every rank when every
    // rank made the same sequence of allocations (0 for the legacy symmetric buffer). The
    // zero-copy kernels publish it and compare it with every peer's before touching any data
    // (kernels/pool.cuh). The other kernels ignore it.
    uint64_t pool_tag;
    // The multicast address of every rank's bound allocation (kernels/multimem.cuh), 0 when
    // no multicast object is set up. Only the multimem kernels read it.
    uint64_t mc_base;
    // The call's identity (src/kernels/abi.rs `call_ident`): kernel << 11 | dtype << 9 |
    // length mod 511, never 0 and below 2^16. Every barrier flag carries it beside the epoch
    // (epoch << 16 | ident), so a rank that meets a flag of the same epoch from another
    // kernel, dtype or length reports ERROR_DIVERGED instead of pairing with it.
    uint32_t ident;
    // FLAG_* bits.
    uint32_t flags;
    // The low-latency kernels' rotation of this call (src/kernels/abi.rs `ll_rotation`): byte
    // o of a low-latency slot is stored at (o + ll_rot) mod ll_slot_bytes (a power of two;
    // ll_rot a multiple of 128, whole cache lines). It grows with the call's length and differs
    // by dtype and kernel, so two ranks that make different low-latency calls poll lines the
    // other never writes and time out, instead of reading each other's data (docs/design.md).
    uint64_t ll_rot;
};

// `SymmArgs::flags`: trigger Programmatic Dependent Launch only when the kernel exits (its
// output complete), for consumer kernels that read the output without `griddepcontrol.wait`.
constexpr uint32_t FLAG_PDL_AT_EXIT = 1;
// `SymmArgs::flags` of the test consumer (symm_consume): it calls `griddepcontrol.wait` first.
constexpr uint32_t FLAG_CONSUMER_WAITS = 2;
// `SymmArgs::flags`: trigger Programmatic Dependent Launch as soon as the kernel has passed its
// own `griddepcontrol.wait` (the call has begun), not after its first wait on the peers. Set by
// the host only when every rank owns its device: the next kernel's blocks then sit resident
// (in their own `griddepcontrol.wait`) beside blocks that are all resident already. Where
// ranks share a device they could take the SMs a peer's blocks still need, and the peer's
// wait on them would never end (src/backend/peer.rs `pdl_trigger_flags`).
constexpr uint32_t FLAG_PDL_EARLY = 4;

static_assert(sizeof(SymmArgs) == 136, "SymmArgs: ten u64, two u32, four u64, two u32, one u64, as in src/kernels/abi.rs");
static_assert(alignof(SymmArgs) == 8, "SymmArgs is 8-aligned");
static_assert(offsetof(SymmArgs, ll_offset) == 48, "SymmArgs::ll_offset");
static_assert(offsetof(SymmArgs, error) == 64, "SymmArgs::error");
static_assert(offsetof(SymmArgs, timeout_ns) == 72, "SymmArgs::timeout_ns");
static_assert(offsetof(SymmArgs, rank) == 80, "SymmArgs::rank");
static_assert(offsetof(SymmArgs, world) == 84, "SymmArgs::world");
static_assert(offsetof(SymmArgs, check_shape) == 88, "SymmArgs::check_shape");
static_assert(offsetof(SymmArgs, check_len) == 96, "SymmArgs::check_len");
static_assert(offsetof(SymmArgs, pool_tag) == 104, "SymmArgs::pool_tag");
static_assert(offsetof(SymmArgs, mc_base) == 112, "SymmArgs::mc_base");
static_assert(offsetof(SymmArgs, ident) == 120, "SymmArgs::ident");
static_assert(offsetof(SymmArgs, flags) == 124, "SymmArgs::flags");

constexpr uint32_t MAX_RANKS = 8;
constexpr uint32_t MAX_BLOCKS = 64;
constexpr uint32_t SLOTS_PER_ROW = 16;
constexpr uint32_t SIGNAL_PHASES = 3;
constexpr uint32_t LL_BUFFERS = 3;
constexpr uint32_t THREADS = 512;

// Error word layout (decoded by src/kernels/abi.rs): kind | phase << 8 | peer << 16 | origin << 24,
// `origin` being the rank whose wait timed out (another rank's when the timeout was pushed).
constexpr uint32_t ERROR_PEER_TIMEOUT = 1;
// A peer's call differs from this rank's (divergence check): the error word is followed by
// {this rank's shape, length, the peer's shape, length} (four u64 at byte 8).
constexpr uint32_t ERROR_DIVERGED = 2;
// The divergence check's slots: [epoch parity 2][block MAX_BLOCKS][source rank MAX_RANKS] of
// CheckSlot, at this offset of every rank's allocation (src/symmetric/mod.rs CHECK_OFFSET).
constexpr uint64_t CHECK_OFFSET = 65536;
// A zero-copy pool call whose pool tag differs between ranks (peer: the first rank whose tag
// differs from this rank's): the ranks' allocation sequences diverged.
constexpr uint32_t ERROR_POOL_MISMATCH = 4;
// The last POOL_TAG_BYTES of every rank's allocation hold the pool tags, [parity 2] of u64.
constexpr uint32_t POOL_TAG_BYTES = 256;

// Epochs must stay below 2^EPOCH_BITS: a barrier flag is epoch << IDENT_BITS | ident. At 20 000
// calls a second that is 446 years; a kernel whose epoch reaches it refuses the call with
// ERROR_EPOCHS_EXHAUSTED (create a new communicator) rather than let a flag wrap.
constexpr uint32_t IDENT_BITS = 16;
constexpr uint32_t EPOCH_BITS = 48;
constexpr uint32_t ERROR_EPOCHS_EXHAUSTED = 5;
// Divergence records whose shape word has this bit were found by a barrier flag (the shape
// word is then the ident), not by the divergence check.
constexpr uint64_t RECORD_IDENT = 1ull << 63;
// Barrier phases, as reported in the error word (src/error.rs BarrierPhase).
enum Phase : uint32_t { PHASE_START = 0, PHASE_MIDDLE = 1, PHASE_END = 2, PHASE_ARRIVAL = 3, PHASE_CHECK = 4 };

// One peer's call as it announced it to this rank for the divergence check.
struct CheckSlot {
    uint64_t shape;  // shape and length first: one 16-byte store (16-byte aligned)
    uint64_t len;
    uint64_t epoch;  // written last, with release
    uint64_t pad;
};
static_assert(offsetof(CheckSlot, shape) == 0 && offsetof(CheckSlot, epoch) == 16, "CheckSlot layout");
static_assert(sizeof(CheckSlot) == 32, "CheckSlot is 32 bytes");

// Call bookkeeping in device memory, advanced by the kernels themselves: no host state per
// call, so a captured graph replays correctly any number of times. One entry per block index
// (MAX_BLOCKS of them at state_offset), so that a block reads and advances only its own and no
// grid-wide counter is needed: block b of a grid of G blocks publishes the completed call into
// entries b, b + G, b + 2G, ... (every entry, whatever G), and the next kernel reads them only
// after this one has completed. Zeroed at setup.
struct BlockState {
    uint64_t calls;   // completed calls; the running call's epoch is calls + 1 (64-bit: never wraps)
    uint32_t poison;  // 0, or the error code of the timeout that stopped the group (pushed by any rank)
    uint32_t unused;
};
static_assert(sizeof(BlockState) == 16, "BlockState is read with one 16-byte load");

}  // namespace symm
