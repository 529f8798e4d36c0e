// Phase B of a resolve and the copy-only kernels (ring 2): `hs_copy_rows` (replay, backup) and
// `hs_copy_compact` (the miss list phase A wrote). Appended to resolver.cu when the module is
// built (kernels/cuda.py: SOURCES); uses its FULL_MASK.

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
extern "C" __global__ void __launch_bounds__(256, 2) hs_copy_rows(const int* __restrict__ src_idx,
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
    long long g0 = warp * group;
    int s_next = -1, d_next = -1;  // entries of the next group, loaded before this one's copies
    if (lane < group && g0 + lane < n_entries) {
        s_next = src_idx[(g0 + lane) * stride];
        d_next = dst_idx[(g0 + lane) * stride];
    }
    for (; g0 < n_entries; g0 += nwarps * group) {
        const int s = s_next, d = d_next;
        const long long e = g0 + nwarps * group + lane;
        s_next = d_next = -1;
        if (lane < group && e < n_entries) {
            s_next = src_idx[e * stride];
            d_next = dst_idx[e * stride];
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

// Phase B of a resolve: copy the compact miss list (counters[0] pairs written by hs_resolve),
// 4 rows per warp at a time, then the last block to finish resets both counters.
extern "C" __global__ void __launch_bounds__(256, 1) hs_copy_compact(
    const int* __restrict__ miss_list, int* __restrict__ counters, const char* __restrict__ src,
    char* __restrict__ dst, long long row_bytes, int vec) {
    const int count = *(volatile int*)&counters[0];
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int nwarps = (gridDim.x * blockDim.x) >> 5;
    for (int base = warp * 4; base < count; base += nwarps * 4) {
        int s = -1, d = -1;
        if (lane < 4 && base + lane < count) {
            s = miss_list[2 * (base + lane)];
            d = miss_list[2 * (base + lane) + 1];
        }
        int srcs[4], dsts[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            srcs[k] = __shfl_sync(FULL_MASK, s, k);
            dsts[k] = __shfl_sync(FULL_MASK, d, k);
        }
        const int cnt = min(4, count - base);
        switch (vec) {
            case 16: warp_copy_rows<uint4, 3>(src, dst, srcs, dsts, cnt, row_bytes, lane); break;
            case 8: warp_copy_rows<uint2, 3>(src, dst, srcs, dsts, cnt, row_bytes, lane); break;
            case 4: warp_copy_rows<unsigned, 3>(src, dst, srcs, dsts, cnt, row_bytes, lane); break;
            default: warp_copy_rows<unsigned char, 4>(src, dst, srcs, dsts, cnt, row_bytes, lane);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(&counters[1], 1) == (int)gridDim.x - 1) {
            counters[0] = 0;
            counters[1] = 0;
            __threadfence();
        }
    }
}
