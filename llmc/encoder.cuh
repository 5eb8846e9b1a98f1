/*
 * Encoder: token + position embedding, forward and backward.
 *
 * Shapes: tokens (B,T) int; wte (Vp,C), wpe (maxT,C), x (B,T,C), all
 * row-major floatX; N = B*T.
 *
 * The backward pass scatters dx rows into wte rows, and a token can occur
 * many times in a batch. Instead of atomics, the host groups the positions by
 * token (a counting sort, stable in position order) and one block owns each
 * distinct token's wte row: it sums that token's dx rows in position order in
 * fp32 and adds the sum to the row once. wpe rows are owned by position t and
 * summed over b in order. Deterministic, no atomics.
 *
 * Status: compiles, unverified on GPU.
 */
#ifndef REMAT_ENCODER_CUH
#define REMAT_ENCODER_CUH

#include "cuda_common.cuh"

/* x[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]; one thread per element. */
__global__ void encoder_forward_kernel(floatX* x, const int* tokens, const floatX* wte, const floatX* wpe, int N, int T, int C) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)N * C) return;
    int bt = (int)(i / C), c = (int)(i % C);
    int t = bt % T;
    x[i] = from_f32<floatX>(to_f32(wte[(size_t)tokens[bt] * C + c]) + to_f32(wpe[(size_t)t * C + c]));
}

static inline void gpu_encoder_forward(floatX* x, const int* tokens, const floatX* wte, const floatX* wpe, int B, int T, int C,
                                       cudaStream_t stream) {
    size_t n = (size_t)B * T * C;
    encoder_forward_kernel<<<grid_for(n, 256), 256, 0, stream>>>(x, tokens, wte, wpe, B * T, T, C);
    CUDA_CHECK_LAUNCH();
}

/* Token buckets, built on the host from the B*T input tokens, laid out in one
 * int array of at most 3N+1 entries:
 *   [0, U)          the U distinct tokens, ascending
 *   [U, 2U+1)       start of each token's positions in the list below, then N
 *   [2U+1, 2U+1+N)  positions bt grouped by token, ascending within a token
 * `count` is scratch of V ints. Returns U. */
static inline int encoder_build_buckets(int* out, int* count, const int* tokens, int N, int V) {
    memset(count, 0, (size_t)V * sizeof(int));
    for (int i = 0; i < N; i++) count[tokens[i]]++;
    int U = 0;
    for (int v = 0; v < V; v++)
        if (count[v]) out[U++] = v;
    int* starts = out + U;
    int* pos = out + 2 * U + 1;
    int run = 0;
    for (int u = 0; u < U; u++) { /* count[v] becomes the next free slot of token v */
        int v = out[u], k = count[v];
        starts[u] = run;
        count[v] = run;
        run += k;
    }
    starts[U] = run;
    for (int i = 0; i < N; i++) pos[count[tokens[i]]++] = i;
    return U;
}

/* dwte[token,:] += sum over that token's positions (in order) of dx[bt,:];
 * dwte floatX, or fp32 where the token table's gradient is accumulated in
 * fp32 (plan.h). grid (U, ceil(C/256)); block 256 threads over channels. */
template <typename G>
__global__ void encoder_backward_wte_kernel(G* dwte, const floatX* dx, const int* buckets, int U, int C) {
    int u = blockIdx.x;
    int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int* starts = buckets + U;
    const int* pos = buckets + 2 * U + 1;
    float acc = 0.0f;
    for (int k = starts[u]; k < starts[u + 1]; k++) acc += to_f32(dx[(size_t)pos[k] * C + c]);
    G* dst = dwte + (size_t)buckets[u] * C + c;
    *dst = from_f32<G>(to_f32(*dst) + acc);
}

/* dwpe[t,:] += sum over b (in order) of dx[b,t,:]; one thread per (t, c). */
__global__ void encoder_backward_wpe_kernel(floatX* dwpe, const floatX* dx, int B, int T, int C) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)T * C) return;
    float acc = 0.0f;
    for (int b = 0; b < B; b++) acc += to_f32(dx[(size_t)b * T * C + i]);
    dwpe[i] = from_f32<floatX>(to_f32(dwpe[i]) + acc);
}

/* d_buckets: the device copy of encoder_build_buckets' output, U its count.
 * dwte: floatX* or float* (see the kernel). */
template <typename G>
static inline void gpu_encoder_backward(G* dwte, floatX* dwpe, const floatX* dx, const int* d_buckets, int U,
                                        int B, int T, int C, cudaStream_t stream) {
    if (U > 0) {
        dim3 grid((unsigned)U, (unsigned)ceil_div((size_t)C, 256));
        encoder_backward_wte_kernel<G><<<grid, 256, 0, stream>>>(dwte, dx, d_buckets, U, C);
        CUDA_CHECK_LAUNCH();
    }
    size_t n = (size_t)T * C;
    encoder_backward_wpe_kernel<<<grid_for(n, 256), 256, 0, stream>>>(dwpe, dx, B, T, C);
    CUDA_CHECK_LAUNCH();
}

#endif
