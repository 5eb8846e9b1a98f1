/*
 * mma.h stand-in for remat's CPU emulator of CUDA (dev/emu; not a GPU): the
 * WMMA API, namespace nvcuda::wmma (CUDA C++ Programming Guide, "Warp Matrix
 * Functions"), for the 16x16x16 shape with __nv_bfloat16 or __half inputs and
 * a float accumulator.
 *
 * Why it exists: the tensor-core attention kernels multiply tiles with WMMA,
 * and their logic must be tested without a GPU. CUDA leaves unspecified which
 * tile element x[i] of a lane's fragment holds, so kernel code that assumes a
 * layout works on one GPU generation and fails on another. Here:
 *   - A fragment holds num_elements elements per lane, as the real header
 *     declares: 8 for bf16 A/B and for the float accumulator (32 lanes x 8 =
 *     the 256 elements of the tile), 16 for __half A/B (each element held
 *     twice in the warp). Which element x[i] of lane l holds is a fixed,
 *     deliberately scrambled mapping (wmma_map::element below), different for
 *     matrix_a, matrix_b and accumulator, so code that assumes a layout of
 *     x[] gets wrong results. It is the same for every fragment of one kind:
 *     uniform elementwise operations work, and so does learning the mapping
 *     by loading a matrix of row (or column) numbers. mma_sync stops if the
 *     two copies of a __half element differ (x[] changed per lane or index:
 *     a GPU reads one copy or the other).
 *   - Fragments start as NaN (0xff bytes), as poisoned memory does: a
 *     fragment used before load_matrix_sync or fill_fragment shows.
 *   - load_matrix_sync, store_matrix_sync and mma_sync are warp operations:
 *     every lane of the warp must reach the same call with the same mptr,
 *     ldm and layout, or the program stops (as with a divergent shuffle).
 *     fill_fragment is per thread, as in CUDA.
 *   - The documented preconditions stop the program: mptr 256-bit (32-byte)
 *     aligned, ldm a multiple of 8 for 16-bit elements and of 4 for float;
 *     the tile (16 rows or columns at stride ldm) inside one device or pinned
 *     block or this block's shared memory (PTX wmma.load/store address
 *     global or shared memory); for stores, ldm >= 16 (smaller strides make
 *     lanes write the same addresses).
 *   - mma_sync computes D = A*B + C in fp32: each product of two 16-bit
 *     values is exact in float; the sum starts from C and adds the products
 *     for k = 0..15 in order, rounding each addition in float. Tensor cores
 *     sum in another order and precision: results agree to rounding with a
 *     GPU's, not bitwise. d may be c.
 * Everything else of the real header (other shapes and types, __half
 * accumulators, satf, element_type, ...) is absent: using it is a compile
 * error, not a guess.
 */
#ifndef REMAT_EMU_MMA_H
#define REMAT_EMU_MMA_H

#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "cuda_runtime.h"

namespace nvcuda {
namespace wmma {

struct row_major;
struct col_major;
struct matrix_a;
struct matrix_b;
struct accumulator;

enum layout_t { mem_row_major, mem_col_major };

template <typename T, int size> struct __align__(8) __frag_base {
    enum { num_elements = size };
    T x[size];
    __frag_base() { memset(x, 0xff, sizeof(x)); }
};

template <typename Use, int m, int n, int k, typename T, typename Layout = void> class fragment;
template <> class fragment<matrix_a, 16, 16, 16, __nv_bfloat16, row_major> : public __frag_base<__nv_bfloat16, 8> {};
template <> class fragment<matrix_a, 16, 16, 16, __nv_bfloat16, col_major> : public __frag_base<__nv_bfloat16, 8> {};
template <> class fragment<matrix_b, 16, 16, 16, __nv_bfloat16, row_major> : public __frag_base<__nv_bfloat16, 8> {};
template <> class fragment<matrix_b, 16, 16, 16, __nv_bfloat16, col_major> : public __frag_base<__nv_bfloat16, 8> {};
template <> class fragment<matrix_a, 16, 16, 16, __half, row_major> : public __frag_base<__half, 16> {};
template <> class fragment<matrix_a, 16, 16, 16, __half, col_major> : public __frag_base<__half, 16> {};
template <> class fragment<matrix_b, 16, 16, 16, __half, row_major> : public __frag_base<__half, 16> {};
template <> class fragment<matrix_b, 16, 16, 16, __half, col_major> : public __frag_base<__half, 16> {};
template <> class fragment<accumulator, 16, 16, 16, float> : public __frag_base<float, 8> {};

}  // namespace wmma
}  // namespace nvcuda

namespace emu {
namespace wmma_map {

enum Kind { A, B, ACC };

/* A nonlinear function of the 4-bit x, one for each (k, m): for element below. */
constexpr int mix(int x, int k, int m) { return ((x * m + k) * (x + 3)) & 15; }

/* The tile element (row * 16 + col; for matrix_b row is k and col is n) that
 * x[i] of lane `lane` holds in a fragment of kind k with n elements a lane.
 * The slot lane * n + i goes through an affine bijection modulo 32 * n (256
 * or 512 slots; with 512 the low 8 bits keep every element twice), then two
 * Feistel rounds (column ^= mix(row), row ^= mix(column)), each a bijection
 * of the tile: a fixed mapping onto the whole tile where a lane's elements
 * share no row or column pattern and hardly any slot matches the row-major,
 * column-major or mma.sync layouts, so no layout a kernel assumes holds. */
constexpr int element(Kind k, int n, int lane, int i) {
    int mul = k == A ? 77 : k == B ? 141 : 173; /* odd: a bijection modulo any power of two */
    int add = k == A ? 200 : k == B ? 37 : 91;
    int e = ((lane * n + i) * mul + add) & (32 * n - 1) & 255;
    int row = e >> 4, col = e & 15;
    col ^= k == A ? mix(row, 11, 7) : k == B ? mix(row, 5, 13) : mix(row, 7, 3);
    row ^= k == A ? mix(col, 5, 3) : k == B ? mix(col, 9, 11) : mix(col, 2, 5);
    return row * 16 + col;
}

}  // namespace wmma_map

namespace wmma_impl {

using namespace nvcuda::wmma;
typedef fragment<accumulator, 16, 16, 16, float> Acc;

template <typename Use> struct UseOf;
template <> struct UseOf<matrix_a> { static constexpr wmma_map::Kind kind = wmma_map::A; };
template <> struct UseOf<matrix_b> { static constexpr wmma_map::Kind kind = wmma_map::B; };
template <> struct UseOf<accumulator> { static constexpr wmma_map::Kind kind = wmma_map::ACC; };

template <typename T> struct NoDeduce { typedef T type; };

/* What one lane passes to load_matrix_sync / store_matrix_sync: its fragment
 * (F const for a store) and the memory (P const for a load). */
template <typename F, typename P> struct MemArgs {
    F* frag;
    P* ptr;
    unsigned ldm;
    bool col_major;
    CallSite where;
};

/* The per-lane preconditions, checked before the lane waits for its warp. */
template <typename T> inline void check_mem(const char* api, const CallSite& w, const void* p, unsigned ldm, bool store) {
    const unsigned mult = sizeof(T) == 2 ? 8 : 4;
    if ((uintptr_t)p % 32)
        fatal("%s (%s:%d): mptr %p is not 256-bit (32-byte) aligned", api, w.file, w.line, p);
    if (ldm % mult)
        fatal("%s (%s:%d): ldm %u is not a multiple of %u (for %zu-byte elements it must be a multiple of 16 bytes)", api, w.file, w.line,
              ldm, mult, sizeof(T));
    if (store && ldm < 16)
        fatal("%s (%s:%d): ldm %u is below 16: the tile's rows (or columns) overlap and lanes store to the same addresses", api, w.file,
              w.line, ldm);
    check_kernel_range(api, w, p, ((size_t)15 * ldm + 16) * sizeof(T));
}

/* CUDA: mptr, ldm and layout must be the same in every lane of the warp. */
template <typename M> inline const M& same_in_all(const char* api, void* const lanes[32]) {
    const M& a = *(const M*)lanes[0];
    for (int l = 1; l < 32; l++) {
        const M& b = *(const M*)lanes[l];
        if (b.ptr != a.ptr || b.ldm != a.ldm || b.col_major != a.col_major)
            fatal("%s (%s:%d): lane %d passes mptr %p, ldm %u, %s but lane 0 mptr %p, ldm %u, %s: they must be the same in every lane",
                  api, a.where.file, a.where.line, l, (const void*)b.ptr, b.ldm, b.col_major ? "column-major" : "row-major",
                  (const void*)a.ptr, a.ldm, a.col_major ? "column-major" : "row-major");
    }
    return a;
}

/* The tile's 16 rows (row-major) or columns of 16 elements at stride ldm:
 * read or written by every lane of the warp (racecheck). */
template <typename T> inline void warp_tile_access(const T* p, unsigned ldm, bool write, const CallSite& where) {
    race_warp_access(p, 16, 16 * sizeof(T), (size_t)ldm * sizeof(T), write, where);
}

/* The warp collectives below run as lane 0's thread but act for the whole
 * warp: they are not instrumented (-fsanitize=thread) and report their tile
 * access as the warp's instead. */
template <typename F, typename Use, typename T> __attribute__((no_sanitize_thread)) void load_all(void* const lanes[32]) {
    typedef MemArgs<F, const T> M;
    const M& a = same_in_all<M>("wmma::load_matrix_sync", lanes);
    warp_tile_access(a.ptr, a.ldm, false, a.where);
    for (int l = 0; l < 32; l++) {
        F& f = *((const M*)lanes[l])->frag;
        for (int i = 0; i < F::num_elements; i++) {
            int e = wmma_map::element(UseOf<Use>::kind, F::num_elements, l, i), r = e >> 4, c = e & 15;
            f.x[i] = a.ptr[a.col_major ? (size_t)c * a.ldm + r : (size_t)r * a.ldm + c];
        }
    }
}

__attribute__((no_sanitize_thread)) inline void store_all(void* const lanes[32]) {
    typedef MemArgs<const Acc, float> M;
    const M& a = same_in_all<M>("wmma::store_matrix_sync", lanes);
    warp_tile_access(a.ptr, a.ldm, true, a.where);
    for (int l = 0; l < 32; l++) {
        const Acc& f = *((const M*)lanes[l])->frag;
        for (int i = 0; i < Acc::num_elements; i++) {
            int e = wmma_map::element(wmma_map::ACC, Acc::num_elements, l, i), r = e >> 4, c = e & 15;
            a.ptr[a.col_major ? (size_t)c * a.ldm + r : (size_t)r * a.ldm + c] = f.x[i];
        }
    }
}

template <typename F> inline void post(const char* api, WarpCollective fn, F& args) {
    warp_collective(args.where.line, args.where.file, api, fn, &args);
}

template <typename FA, typename FB> struct MmaArgs {
    Acc* d;
    const FA* a;
    const FB* b;
    const Acc* c;
    CallSite where;
};

/* The warp's 16x16 tile of an A or B operand as floats, from every lane's
 * fragment. A __half fragment holds each element twice: both copies must
 * agree bit for bit. */
template <typename F, typename Use> __attribute__((no_sanitize_thread)) void gather(float* tile, const F* const frags[32], const CallSite& w) {
    const int n = F::num_elements;
    int slot[256]; /* lane * n + i of the copy seen first, or -1 */
    for (int e = 0; e < 256; e++) slot[e] = -1;
    for (int l = 0; l < 32; l++)
        for (int i = 0; i < n; i++) {
            int e = wmma_map::element(UseOf<Use>::kind, n, l, i);
            if (slot[e] >= 0) {
                unsigned short u, v;
                memcpy(&u, &frags[l]->x[i], 2);
                memcpy(&v, &frags[slot[e] / n]->x[slot[e] % n], 2);
                if (u != v)
                    fatal("wmma::mma_sync (%s:%d): element (%d, %d) of the %s fragment is held twice, by lane %d x[%d] (0x%04x) and "
                          "lane %d x[%d] (0x%04x), and the copies differ: x[] was changed per lane or index, and a GPU uses one copy "
                          "or the other",
                          w.file, w.line, e >> 4, e & 15, UseOf<Use>::kind == wmma_map::A ? "matrix_a" : "matrix_b", slot[e] / n,
                          slot[e] % n, v, l, i, u);
            }
            slot[e] = l * n + i;
            tile[e] = (float)frags[l]->x[i];
        }
}

template <typename FA, typename FB> __attribute__((no_sanitize_thread)) void mma_all(void* const lanes[32]) {
    typedef MmaArgs<FA, FB> M;
    const FA* fa[32];
    const FB* fb[32];
    for (int l = 0; l < 32; l++) {
        fa[l] = ((const M*)lanes[l])->a;
        fb[l] = ((const M*)lanes[l])->b;
    }
    const CallSite& w = ((const M*)lanes[0])->where;
    float a[256], b[256], c[256];
    gather<FA, matrix_a>(a, fa, w);
    gather<FB, matrix_b>(b, fb, w);
    for (int l = 0; l < 32; l++) /* all of C before any of D: d may be c */
        for (int i = 0; i < Acc::num_elements; i++)
            c[wmma_map::element(wmma_map::ACC, Acc::num_elements, l, i)] = ((const M*)lanes[l])->c->x[i];
    for (int l = 0; l < 32; l++) {
        Acc& d = *((const M*)lanes[l])->d;
        for (int i = 0; i < Acc::num_elements; i++) {
            int e = wmma_map::element(wmma_map::ACC, Acc::num_elements, l, i), r = e >> 4, col = e & 15;
            float s = c[e];
            for (int k = 0; k < 16; k++) s += a[r * 16 + k] * b[k * 16 + col];
            d.x[i] = s;
        }
    }
}

}  // namespace wmma_impl
}  // namespace emu

namespace nvcuda {
namespace wmma {

/* Per thread, as in CUDA (normally called by every lane with the same v). */
template <typename T, int size> inline void fill_fragment(__frag_base<T, size>& f, const typename emu::wmma_impl::NoDeduce<T>::type& v) {
    for (int i = 0; i < size; i++) f.x[i] = v;
}

/* matrix_a or matrix_b: the layout in memory is the fragment's Layout. */
template <typename Use, typename T, typename Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& a, const T* mptr, unsigned ldm,
                             emu::CallSite where = {__builtin_LINE(), __builtin_FILE()}) {
    static_assert(!std::is_void<Layout>::value, "emu: load_matrix_sync of an accumulator takes a layout_t (mem_row_major or mem_col_major)");
    typedef fragment<Use, 16, 16, 16, T, Layout> F;
    emu::wmma_impl::check_mem<T>("wmma::load_matrix_sync", where, mptr, ldm, false);
    emu::wmma_impl::MemArgs<F, const T> args{&a, mptr, ldm, std::is_same<Layout, col_major>::value, where};
    emu::wmma_impl::post("wmma::load_matrix_sync", emu::wmma_impl::load_all<F, Use, T>, args);
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& a, const float* mptr, unsigned ldm, layout_t layout,
                             emu::CallSite where = {__builtin_LINE(), __builtin_FILE()}) {
    typedef fragment<accumulator, 16, 16, 16, float> F;
    if (layout != mem_row_major && layout != mem_col_major)
        emu::fatal("wmma::load_matrix_sync (%s:%d): layout %d is neither mem_row_major nor mem_col_major", where.file, where.line, (int)layout);
    emu::wmma_impl::check_mem<float>("wmma::load_matrix_sync", where, mptr, ldm, false);
    emu::wmma_impl::MemArgs<F, const float> args{&a, mptr, ldm, layout == mem_col_major, where};
    emu::wmma_impl::post("wmma::load_matrix_sync", emu::wmma_impl::load_all<F, accumulator, float>, args);
}

inline void store_matrix_sync(float* mptr, const fragment<accumulator, 16, 16, 16, float>& a, unsigned ldm, layout_t layout,
                              emu::CallSite where = {__builtin_LINE(), __builtin_FILE()}) {
    typedef fragment<accumulator, 16, 16, 16, float> F;
    if (layout != mem_row_major && layout != mem_col_major)
        emu::fatal("wmma::store_matrix_sync (%s:%d): layout %d is neither mem_row_major nor mem_col_major", where.file, where.line,
                   (int)layout);
    emu::wmma_impl::check_mem<float>("wmma::store_matrix_sync", where, mptr, ldm, true);
    emu::wmma_impl::MemArgs<const F, float> args{&a, mptr, ldm, layout == mem_col_major, where};
    emu::wmma_impl::post("wmma::store_matrix_sync", emu::wmma_impl::store_all, args);
}

template <typename T, typename LA, typename LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, T, LB>& b, const fragment<accumulator, 16, 16, 16, float>& c,
                     emu::CallSite where = {__builtin_LINE(), __builtin_FILE()}) {
    typedef fragment<matrix_a, 16, 16, 16, T, LA> FA;
    typedef fragment<matrix_b, 16, 16, 16, T, LB> FB;
    emu::wmma_impl::MmaArgs<FA, FB> args{&d, &a, &b, &c, where};
    emu::wmma_impl::post("wmma::mma_sync", emu::wmma_impl::mma_all<FA, FB>, args);
}

}  // namespace wmma
}  // namespace nvcuda

#endif
