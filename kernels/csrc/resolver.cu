// Resolver kernels (ring 2): phase A `hs_resolve` (one block per batch row: classify, LRU, plan)
// and phase B `hs_copy_rows` (many blocks: copy the planned rows, also used for replay and backup).
// Compiled at run time by kernels/cuda.py with cupy.RawModule. Contract: docs/architecture.md,
// "The resolver contract"; the twin is kernels/reference.py.

#define FULL_MASK 0xffffffffu

// Exclusive block-wide prefix sum of `v`; `total` gets the block sum (same in every thread).
// Needs blockDim.x a multiple of 32 and <= 1024; `scratch` holds 32 ints. Every thread must call it.
__device__ __forceinline__ int block_exclusive_scan(int v, int* scratch, int& total) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    int x = v;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        int y = __shfl_up_sync(FULL_MASK, x, off);
        if (lane >= off) x += y;
    }
    if (lane == 31) scratch[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int t = lane < nwarps ? scratch[lane] : 0;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            int y = __shfl_up_sync(FULL_MASK, t, off);
            if (lane >= off) t += y;
        }
        scratch[lane] = t;
    }
    __syncthreads();
    const int before = warp > 0 ? scratch[warp - 1] : 0;
    total = scratch[nwarps - 1];
    __syncthreads();  // scratch is reused by the next call
    return before + x - v;
}

__device__ __forceinline__ unsigned hash_pos(int p, int bits) {
    return ((unsigned)p * 2654435761u) >> (32 - bits);
}

// Phase A. grid = (B), block = (T), T a multiple of 32 in [64, 1024].
// Dynamic shared memory: 2*cap + 3*K + 64 ints, then H bytes (cap = 1 << hash_bits >= 2K).
// Writes out_rows, plan (every entry: (-1, -1) unless a miss copy), slot_pos and lru in place.
extern "C" __global__ void hs_resolve(
    const int* __restrict__ top_k, int K, const void* __restrict__ seq_lens, int lens64,
    const int* __restrict__ state_idx, int* __restrict__ slot_pos, int* __restrict__ lru, int H,
    const int* __restrict__ slot_rows, const int* __restrict__ resident_table,
    const int* __restrict__ host_table, int P, int page_size, int* __restrict__ out_rows,
    int* __restrict__ plan, int hash_bits) {
    extern __shared__ int smem[];
    const int cap = 1 << hash_bits;
    int* h_keys = smem;
    int* h_vals = h_keys + cap;
    int* slot_of = h_vals + cap;  // per top-k index: slot of a hit, -2 miss, -1 settled
    int* rank_of = slot_of + K;   // rank among hits or among misses, in top-k order
    int* victim = rank_of + K;    // evicted slots, LRU order
    int* scratch = victim + K;    // 64 ints
    unsigned char* hit_flag = reinterpret_cast<unsigned char*>(scratch + 64);

    const int b = blockIdx.x;
    const int tid = threadIdx.x;
    const int T = blockDim.x;
    const long long n = lens64 ? static_cast<const long long*>(seq_lens)[b]
                               : (long long)static_cast<const int*>(seq_lens)[b];
    const int* tk = top_k + (size_t)b * K;
    int* out = out_rows + (size_t)b * K;
    int* pl = plan + (size_t)b * K * 2;
    const int* srow = slot_rows + (size_t)b * (H + 1);
    const int* rtab = resident_table + (size_t)b * P;
    const int* htab = host_table + (size_t)b * P;

    if (n <= 0) {  // padded row: -1 everywhere, no state touched
        for (int j = tid; j < K; j += T) {
            out[j] = -1;
            pl[2 * j] = -1;
            pl[2 * j + 1] = -1;
        }
        return;
    }
    const int s = state_idx[b];
    int* sp = slot_pos + (size_t)s * H;
    int* lr = lru + (size_t)s * H;

    if (n <= H) {  // short path: slot p holds position p; lookup only
        for (int j = tid; j < K; j += T) {
            const int p = tk[j];
            int row = -1;
            if (p >= 0) {
                const int blk = rtab[p / page_size];
                row = blk >= 0 ? blk * page_size + p % page_size : srow[p];
            }
            out[j] = row;
            pl[2 * j] = -1;
            pl[2 * j + 1] = -1;
        }
        for (int i = tid; i < n; i += T) sp[i] = i;
        return;
    }

    // Long path. 1) settle padding / resident / newest; hash the remaining positions.
    for (int i = tid; i < cap; i += T) h_keys[i] = -1;
    for (int i = tid; i < H; i += T) hit_flag[i] = 0;
    __syncthreads();
    const int mask = cap - 1;
    for (int j = tid; j < K; j += T) {
        const int p = tk[j];
        pl[2 * j] = -1;
        pl[2 * j + 1] = -1;
        int code = -1;
        if (p < 0) {
            out[j] = -1;
        } else {
            const int blk = rtab[p / page_size];
            if (blk >= 0) {
                out[j] = blk * page_size + p % page_size;
            } else if ((long long)p == n - 1) {
                out[j] = srow[H];
            } else {
                code = -2;
                unsigned h = hash_pos(p, hash_bits);
                while (true) {
                    const int old = atomicCAS(&h_keys[h], -1, p);
                    if (old == -1) {
                        h_vals[h] = j;
                        break;
                    }
                    h = (h + 1) & mask;
                }
            }
        }
        slot_of[j] = code;
    }
    __syncthreads();
    // 2) mark every hit before any eviction.
    for (int i = tid; i < H; i += T) {
        const int q = sp[i];
        if (q < 0) continue;
        unsigned h = hash_pos(q, hash_bits);
        int key;
        while ((key = h_keys[h]) != -1) {
            if (key == q) {
                slot_of[h_vals[h]] = i;
                hit_flag[i] = 1;
                break;
            }
            h = (h + 1) & mask;
        }
    }
    __syncthreads();
    // 3) ranks of hits and misses in top-k order (packed: hits << 16 | misses, tile sums <= 1024).
    int nhit = 0, nmiss = 0;
    for (int base = 0; base < K; base += T) {
        const int j = base + tid;
        const int c = j < K ? slot_of[j] : -1;
        const int v = (c >= 0 ? (1 << 16) : 0) | (c == -2 ? 1 : 0);
        int tot;
        const int ex = block_exclusive_scan(v, scratch, tot);
        if (c >= 0) rank_of[j] = nhit + (ex >> 16);
        if (c == -2) rank_of[j] = nmiss + (ex & 0xffff);
        nhit += tot >> 16;
        nmiss += tot & 0xffff;
    }
    // 4) walk the LRU (oldest first): the first nmiss non-hit slots are evicted, the rest keep
    //    their order at the front. Writes go to index <= the index read, so in place is safe.
    int nev = 0;
    for (int base = 0; base < H; base += T) {
        const int i = base + tid;
        const int slot = i < H ? lr[i] : -1;
        const int ev = (i < H && !hit_flag[slot]) ? 1 : 0;
        int tot;
        const int ex = block_exclusive_scan(ev, scratch, tot);  // its barriers order reads before writes
        if (ev) {
            const int r = nev + ex;
            if (r < nmiss) victim[r] = slot;
            else lr[r - nmiss] = slot;
        }
        nev += tot;
    }
    __syncthreads();
    // 5) tail of the LRU: newly filled, then hits; fill slots and write the plan.
    const int fill0 = H - nhit - nmiss;
    const int hit0 = H - nhit;
    for (int j = tid; j < K; j += T) {
        const int c = slot_of[j];
        if (c >= 0) {
            lr[hit0 + rank_of[j]] = c;
            out[j] = srow[c];
        } else if (c == -2) {
            const int p = tk[j];
            const int v = victim[rank_of[j]];
            lr[fill0 + rank_of[j]] = v;
            sp[v] = p;
            const int drow = srow[v];
            out[j] = drow;
            pl[2 * j] = htab[p / page_size] * page_size + p % page_size;
            pl[2 * j + 1] = drow;
        }
    }
}

// Up to 4 rows per warp at once, C vectors of type V per lane and row per window: many independent
// loads in flight before the first store (PCIe latency is long).
template <typename V, int C>
__device__ __forceinline__ void warp_copy_rows(const char* __restrict__ src, char* __restrict__ dst,
                                               const int* srcs, const int* dsts, int cnt,
                                               long long row_bytes, int lane) {
    const long long nv = row_bytes / (long long)sizeof(V);
    for (long long base = 0; base < nv; base += 32 * C) {
        V r[4][C];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (k < cnt) {
                const V* s = reinterpret_cast<const V*>(src + (long long)srcs[k] * row_bytes);
#pragma unroll
                for (int c = 0; c < C; ++c) {
                    const long long idx = base + c * 32 + lane;
                    if (idx < nv) r[k][c] = s[idx];
                }
            }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (k < cnt) {
                V* d = reinterpret_cast<V*>(dst + (long long)dsts[k] * row_bytes);
#pragma unroll
                for (int c = 0; c < C; ++c) {
                    const long long idx = base + c * 32 + lane;
                    if (idx < nv) d[idx] = r[k][c];
                }
            }
        }
    }
}

// Phase B / replay / backup. Entry e copies row src_idx[e*stride] of `src` to row
// dst_idx[e*stride] of `dst` (skipped when the source index is < 0), for every layer
// blockIdx.y (layer strides in bytes). Each warp reads `group` (1..32) entries at once.
// vec: bytes per access (16, 8, 4 or 1); row_bytes and both bases are multiples of it.
extern "C" __global__ void hs_copy_rows(const int* __restrict__ src_idx,
                                        const int* __restrict__ dst_idx, int stride,
                                        long long n_entries, const char* __restrict__ src,
                                        long long src_layer_stride, char* __restrict__ dst,
                                        long long dst_layer_stride, long long row_bytes, int vec,
                                        int group) {
    src += (long long)blockIdx.y * src_layer_stride;
    dst += (long long)blockIdx.y * dst_layer_stride;
    const int lane = threadIdx.x & 31;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long g0 = warp * group; g0 < n_entries; g0 += nwarps * group) {
        const long long e = g0 + lane;
        int s = -1, d = -1;
        if (lane < group && e < n_entries) {
            s = src_idx[e * stride];
            if (s >= 0) d = dst_idx[e * stride];
        }
        unsigned act = __ballot_sync(FULL_MASK, s >= 0);
        while (act) {
            int srcs[4], dsts[4], cnt = 0;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                int l = act ? __ffs(act) - 1 : 0;
                srcs[k] = __shfl_sync(FULL_MASK, s, l);
                dsts[k] = __shfl_sync(FULL_MASK, d, l);
                if (act) {
                    act &= act - 1;
                    ++cnt;
                }
            }
            switch (vec) {
                case 16: warp_copy_rows<uint4, 3>(src, dst, srcs, dsts, cnt, row_bytes, lane); break;
                case 8: warp_copy_rows<uint2, 3>(src, dst, srcs, dsts, cnt, row_bytes, lane); break;
                case 4: warp_copy_rows<unsigned, 3>(src, dst, srcs, dsts, cnt, row_bytes, lane); break;
                default: warp_copy_rows<unsigned char, 4>(src, dst, srcs, dsts, cnt, row_bytes, lane);
            }
        }
    }
}
