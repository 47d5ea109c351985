// The mma.sync attention kernel for head dim 128 (attention_mma.cuh): one instantiation per
// translation unit, so that the head dims compile in parallel.
#include "attention_mma.cuh"

namespace dsv41 {
namespace attn {
template cudaError_t launch_mma_d<128>(const KernelArgs& a, cudaStream_t stream);
template cudaError_t prepare_mma_d<128>();
}  // namespace attn
}  // namespace dsv41
