/* Two C entry points over the header-only NVTX3 API, so the Rust side can open and close
 * named ranges that Nsight Systems shows on the timeline. Built by build.rs only when the
 * NVTX headers are found next to nvcc. */
#include <nvtx3/nvToolsExt.h>

void symm_nvtx_push(const char* message) { nvtxRangePushA(message); }

void symm_nvtx_pop(void) { nvtxRangePop(); }
