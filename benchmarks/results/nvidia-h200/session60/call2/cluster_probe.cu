// How many clusters of n CTAs (one CTA an SM: 384 threads, 200 KB of shared memory, as SddmmWgmmaXrWsKernel) the GPU
// holds at once (cudaOccupancyMaxActiveClusters), n = 1..16.
#include <cstdio>
#include <cuda_runtime.h>
__global__ void Probe(float* out) {
  extern __shared__ float smem[];
  smem[threadIdx.x] = threadIdx.x;
  __syncthreads();
  if (out) out[blockIdx.x] = smem[0];
}
int main() {
  int smem = 200 * 1024, sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaFuncSetAttribute(Probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncSetAttribute(Probe, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  printf("SMs %d\n", sms);
  for (int n = 1; n <= 16; ++n) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(n, 1, 1);
    cfg.blockDim = dim3(384);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = n; attr.val.clusterDim.y = 1; attr.val.clusterDim.z = 1;
    cfg.attrs = &attr; cfg.numAttrs = 1;
    int clusters = -1;
    cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, Probe, &cfg);
    printf("cluster %2d: %3d clusters at once = %3d CTAs (%s)\n", n, clusters, clusters * n, cudaGetErrorString(e));
  }
  return 0;
}
