// Zero-copy bandwidth probe: how fast the GPU's SMs read pinned host memory (what the async decode does for a
// missed expert) against the copy engine (what the sync mode's copies and the async mode's admissions do).
//
// Build and run (tools/gpu/pipeline.py does it on the loaned machine):
//   nvcc -O2 -arch=sm_90 -o zero_copy_probe tools/gpu/zero_copy_probe.cu && ./zero_copy_probe [MiB] [reps]
// Prints one JSON object: the sizes, and the median GB/s of each way over the repetitions.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                                   \
    do {                                                                                           \
        cudaError_t err_ = (x);                                                                    \
        if (err_ != cudaSuccess) {                                                                 \
            std::fprintf(stderr, "error: %s: %s\n", #x, cudaGetErrorString(err_));                 \
            std::exit(2);                                                                          \
        }                                                                                          \
    } while (0)

// Every thread reads 16-byte words strided over the buffer and folds them into one sum, so the loads
// cannot be optimised away; one atomic per thread at the end.
__global__ void read_all(const uint4 * __restrict__ src, size_t n_words, unsigned long long * out) {
    unsigned long long acc = 0;
    const size_t stride = (size_t) gridDim.x * blockDim.x;
    for (size_t i = (size_t) blockIdx.x * blockDim.x + threadIdx.x; i < n_words; i += stride) {
        const uint4 v = src[i];
        acc += (unsigned long long) v.x + v.y + v.z + v.w;
    }
    atomicAdd(out, acc);
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char ** argv) {
    const size_t mib  = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 256;
    const int    reps = argc > 2 ? std::atoi(argv[2]) : 9;
    const size_t size = mib << 20;

    int dev = 0, n_sm = 0;
    CHECK(cudaGetDevice(&dev));
    CHECK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, dev));

    void * host = nullptr;  // pinned and mapped: what ggml-cuda's host buffer type allocates for the experts
    void * device = nullptr;
    unsigned long long * sum = nullptr;
    CHECK(cudaMallocHost(&host, size));
    CHECK(cudaMalloc(&device, size));
    CHECK(cudaMalloc(&sum, sizeof(*sum)));
    for (size_t i = 0; i < size; i += 4096) {
        ((char *) host)[i] = (char) i;  // touch every page
    }
    cudaStream_t stream;
    CHECK(cudaStreamCreate(&stream));
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));

    std::vector<double> zero_copy, copy_engine, device_read;
    for (int r = 0; r < reps + 1; ++r) {  // the first of each is a warm-up
        float ms = 0.0f;
        // SMs reading pinned host memory through unified addressing (the expert table's host entries)
        CHECK(cudaEventRecord(t0, stream));
        read_all<<<n_sm * 8, 256, 0, stream>>>((const uint4 *) host, size / sizeof(uint4), sum);
        CHECK(cudaEventRecord(t1, stream));
        CHECK(cudaEventSynchronize(t1));
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        if (r) zero_copy.push_back(size / (ms * 1e-3) / 1e9);
        // the copy engine: one host-to-device copy of the same bytes
        CHECK(cudaEventRecord(t0, stream));
        CHECK(cudaMemcpyAsync(device, host, size, cudaMemcpyHostToDevice, stream));
        CHECK(cudaEventRecord(t1, stream));
        CHECK(cudaEventSynchronize(t1));
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        if (r) copy_engine.push_back(size / (ms * 1e-3) / 1e9);
        // the same kernel on device memory (what a cached expert costs to read)
        CHECK(cudaEventRecord(t0, stream));
        read_all<<<n_sm * 8, 256, 0, stream>>>((const uint4 *) device, size / sizeof(uint4), sum);
        CHECK(cudaEventRecord(t1, stream));
        CHECK(cudaEventSynchronize(t1));
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        if (r) device_read.push_back(size / (ms * 1e-3) / 1e9);
    }
    CHECK(cudaGetLastError());
    std::printf("{\"gpu\": \"%s\", \"mib\": %zu, \"reps\": %d, \"zero_copy_gb_s\": %.2f, "
                "\"copy_engine_gb_s\": %.2f, \"device_read_gb_s\": %.2f}\n",
                prop.name, mib, reps, median(zero_copy), median(copy_engine), median(device_read));
    CHECK(cudaFreeHost(host));
    CHECK(cudaFree(device));
    CHECK(cudaFree(sum));
    return 0;
}
