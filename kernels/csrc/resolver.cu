// Resolver kernels (ring 2): phase A `hs_resolve` (one block per batch row: classify, LRU, plan)
// and phase B (resolver_copy.cu: many blocks copy the planned rows; also replay and backup).
// Compiled at run time by kernels/cuda.py with cupy.RawModule (followed by resolver_copy.cu and
// resolver_cluster.cu, phase A over thread-block clusters). Contract: docs/architecture.md,
// "The resolver contract"; the twin is kernels/reference.py.

#define FULL_MASK 0xffffffffu
#ifndef HS_STOP  // benchmark-only: return from hs_resolve after stage HS_STOP (profiling aid)
#define HS_STOP 99
#endif
#define HS_STAGE(k) \
    if (HS_STOP == (k)) return;
#ifndef HS_FUSED  // 1: phase A's long path in fewer dependent passes (opt-in; kernels/cuda.py)
#define HS_FUSED 0
#endif

// Block-wide offsets of two warp-uniform counts (warp order): `before_a/b` get the sums of
// lower warps, `total_a/b` the block sums. Every thread must call it; scratch holds 64 ints.
// Warp 0 scans the per-warp counts with shuffles (two barriers, no per-thread loop).
__device__ __forceinline__ void warp_offsets(int a, int b, int* scratch, int& before_a,
                                             int& before_b, int& total_a, int& total_b) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    if (lane == 0) {
        scratch[warp] = a;
        scratch[32 + warp] = b;
    }
    __syncthreads();
    if (warp == 0) {
        int x = lane < nwarps ? scratch[lane] : 0;
        int y = lane < nwarps ? scratch[32 + lane] : 0;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int xs = __shfl_up_sync(FULL_MASK, x, off);
            const int ys = __shfl_up_sync(FULL_MASK, y, off);
            if (lane >= off) {
                x += xs;
                y += ys;
            }
        }
        scratch[lane] = x;  // inclusive prefix over warps
        scratch[32 + lane] = y;
    }
    __syncthreads();
    before_a = warp > 0 ? scratch[warp - 1] : 0;
    before_b = warp > 0 ? scratch[32 + warp - 1] : 0;
    total_a = scratch[nwarps - 1];
    total_b = scratch[32 + nwarps - 1];
    __syncthreads();  // scratch is reused by the next call
}

__device__ __forceinline__ unsigned hash_pos(int p, int bits) {
    return ((unsigned)p * 2654435761u) >> (32 - bits);
}

// Phase A's pieces (the fused long path's; the default one keeps its loops inline, which compiles
// to the very instructions its parity tests passed with: only hash_insert did too). Every thread
// of the block calls each; none has a barrier.

// The state row (slot_pos, lru, slot_rows) into shared memory, hit flags cleared.
__device__ __forceinline__ void stage_state(const int* sp, const int* lr, const int* srow,
                                            int* s_sp, int* s_lr, int* s_srow,
                                            unsigned char* hit_flag, int H, int tid, int T) {
    if ((H & 3) == 0 && ((size_t)sp & 15) == 0 && ((size_t)lr & 15) == 0) {
        for (int i = tid; i < H / 4; i += T) {
            const int4 a = reinterpret_cast<const int4*>(sp)[i];
            const int4 c = reinterpret_cast<const int4*>(lr)[i];
            reinterpret_cast<int4*>(s_sp)[i] = a;
            reinterpret_cast<int4*>(s_lr)[i] = c;
        }
    } else {
#pragma unroll 4
        for (int i = tid; i < H; i += T) {
            s_sp[i] = sp[i];
            s_lr[i] = lr[i];
        }
    }
    if ((H & 3) == 0) {  // hit_flag starts at a multiple of 4 bytes
        for (int i = tid; i < H / 4; i += T) reinterpret_cast<unsigned*>(hit_flag)[i] = 0u;
    } else {
        for (int i = tid; i < H; i += T) hit_flag[i] = 0;
    }
#pragma unroll 4
    for (int i = tid; i <= H; i += T) s_srow[i] = srow[i];
}

// Position q (top-k entry j) into the open-addressing table (keys -1 = empty).
__device__ __forceinline__ void hash_insert(int* h_keys, int* h_vals, int q, int j, int hash_bits,
                                            int mask) {
    unsigned h = hash_pos(q, hash_bits);
    while (true) {
        const int old = atomicCAS(&h_keys[h], -1, q);
        if (old == -1) {
            h_vals[h] = j;
            break;
        }
        h = (h + 1) & mask;
    }
}

// Every hot slot whose position is hashed: its entry's slot_of is the slot, the slot flagged.
__device__ __forceinline__ void mark_hits(const int* s_sp, const int* h_keys, const int* h_vals,
                                          int* slot_of, unsigned char* hit_flag, int H,
                                          int hash_bits, int mask, int tid, int T) {
    for (int i = tid; i < H; i += T) {
        const int q = s_sp[i];
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
}

// Ranks of hits and misses in top-k order over the warp's segment [lo, hi), from the counts of
// the lower warps (bh, bm).
__device__ __forceinline__ void write_ranks(const int* slot_of, int* rank_of, int lo, int hi,
                                            int bh, int bm, int lane, unsigned lt_mask) {
    for (int base = lo; base < hi; base += 32) {
        const int j = base + lane;
        const int c = j < hi ? slot_of[j] : -1;
        const unsigned hb = __ballot_sync(FULL_MASK, c >= 0);
        const unsigned mb = __ballot_sync(FULL_MASK, c == -2);
        if (c >= 0) rank_of[j] = bh + __popc(hb & lt_mask);
        if (c == -2) rank_of[j] = bm + __popc(mb & lt_mask);
        bh += __popc(hb);
        bm += __popc(mb);
    }
}

// The LRU walk over the warp's segment [lo, hi) of the old order (oldest first): the first nmiss
// unhit slots are victims, the others keep their order at the front of the new LRU.
__device__ __forceinline__ void walk_lru(const int* s_lr, const unsigned char* hit_flag,
                                         int* victim, int* lr, int lo, int hi, int be, int nmiss,
                                         int lane, unsigned lt_mask) {
    for (int base = lo; base < hi; base += 32) {
        const int i = base + lane;
        const int slot = i < hi ? s_lr[i] : 0;
        const bool ev = i < hi && !hit_flag[slot];
        const unsigned eb = __ballot_sync(FULL_MASK, ev);
        if (ev) {
            const int r = be + __popc(eb & lt_mask);
            if (r < nmiss) victim[r] = slot;
            else lr[r - nmiss] = slot;
        }
        be += __popc(eb);
    }
}

// Phase A. grid = (B), block = (T), T a multiple of 32 in [64, 1024].
// Dynamic shared memory: 2*cap + 5*K + 3*H + 65 ints, then H bytes (cap = 1 << hash_bits >= 2K; the
// launcher uses >= 4K when it fits: fewer probes).
// Misses are also appended to the compact miss_list ((host_row, device_row) pairs; counters[0]
// counts them) that hs_copy_compact copies and then resets.
// The row's top-k, slot_pos and lru are staged in shared memory with independent loads, so the
// block pays a few global round trips, not one per loop iteration. Order-dependent counting
// (ranks in top-k order, the LRU walk) uses warp ballots over contiguous per-warp segments.
// Writes out_rows, plan (every entry: (-1, -1) unless a miss copy), slot_pos and lru in place.
extern "C" __global__ void hs_resolve(
    const int* __restrict__ top_k, int K, const void* __restrict__ seq_lens, int lens64,
    const int* __restrict__ state_idx, int* __restrict__ slot_pos, int* __restrict__ lru, int H,
    const int* __restrict__ slot_rows, const int* __restrict__ resident_table,
    const int* __restrict__ host_table, int P, int page_size, int* __restrict__ out_rows,
    int* __restrict__ plan, int hash_bits, int* __restrict__ miss_list,
    int* __restrict__ counters) {
    extern __shared__ int smem[];
    HS_STAGE(0)
    const int cap = 1 << hash_bits;
    int* h_keys = smem;
    int* h_vals = h_keys + cap;
    int* s_tk = h_vals + cap;     // K: the row's top-k
    int* slot_of = s_tk + K;      // K: slot of a hit, -2 miss, -1 settled
    int* rank_of = slot_of + K;   // K: resident block first, then rank among hits or misses
    int* victim = rank_of + K;    // K: evicted slots, LRU order
    int* s_sp = victim + K;       // H: slot_pos of the state row
    int* s_lr = s_sp + H;         // H: lru of the state row
    int* s_srow = s_lr + H;       // H+1: slot_rows of the batch row
    int* s_host = s_srow + H + 1; // K: host block of each position's page
    int* scratch = s_host + K;    // 64
    unsigned char* hit_flag = reinterpret_cast<unsigned char*>(scratch + 64);

    const int b = blockIdx.x;
    const int tid = threadIdx.x;
    const int T = blockDim.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int nwarps = T >> 5;
    const unsigned lt_mask = (1u << lane) - 1u;
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
    HS_STAGE(1)

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

#if HS_FUSED
    // Long path in fewer passes (same results as the #else branch, pass for pass):
    // a) the hash table cleared (the only barrier before the inserts);
    // b) one sweep: the state row staged, and each top-k entry's page tables read (both at once),
    //    the entry settled (padding / resident / newest) or hashed;
    // c) every hit marked; d) one block scan of three counts (hits and misses packed in one
    //    int: K < 32768, checked by the launcher; the LRU's evictable slots); e) ranks and the LRU
    //    walk in one pass (disjoint writes), the miss list's base taken.
    const int newest_row = srow[H];
    const int mask = cap - 1;
    for (int i = tid; i < cap / 4; i += T)
        reinterpret_cast<int4*>(h_keys)[i] = make_int4(-1, -1, -1, -1);
    __syncthreads();
    HS_STAGE(2)
    stage_state(sp, lr, srow, s_sp, s_lr, s_srow, hit_flag, H, tid, T);
    for (int j0 = tid; j0 < K; j0 += 4 * T) {  // 4 entries a thread at a time: loads in flight
        int p[4], blk[4], hb[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int j = j0 + u * T;
            p[u] = j < K ? tk[j] : -1;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int pg = p[u] >= 0 ? p[u] / page_size : 0;
            blk[u] = p[u] >= 0 ? rtab[pg] : -1;
            hb[u] = p[u] >= 0 ? htab[pg] : -1;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int j = j0 + u * T;
            if (j >= K) break;
            const int q = p[u];
            s_tk[j] = q;
            s_host[j] = hb[u];
            reinterpret_cast<int2*>(pl)[j] = make_int2(-1, -1);
            int code = -1;
            if (q < 0) {
                out[j] = -1;
            } else if (blk[u] >= 0) {
                out[j] = blk[u] * page_size + q % page_size;
            } else if ((long long)q == n - 1) {
                out[j] = newest_row;
            } else {
                code = -2;
                hash_insert(h_keys, h_vals, q, j, hash_bits, mask);
            }
            slot_of[j] = code;
        }
    }
    __syncthreads();
    HS_STAGE(4)
    mark_hits(s_sp, h_keys, h_vals, slot_of, hit_flag, H, hash_bits, mask, tid, T);
    __syncthreads();
    HS_STAGE(5)
    int nhit, nmiss;
    __shared__ int list_base;
    {
        const int kseg = ((K + nwarps * 32 - 1) / (nwarps * 32)) * 32;
        const int klo = warp * kseg, khi = min(K, klo + kseg);
        const int hseg = ((H + nwarps * 32 - 1) / (nwarps * 32)) * 32;
        const int hlo = warp * hseg, hhi = min(H, hlo + hseg);
        int chm = 0, ce = 0;  // hits << 16 | misses; evictable slots
        for (int base = klo; base < khi; base += 32) {
            const int j = base + lane;
            const int c = j < khi ? slot_of[j] : -1;
            chm += (__popc(__ballot_sync(FULL_MASK, c >= 0)) << 16) +
                   __popc(__ballot_sync(FULL_MASK, c == -2));
        }
        for (int base = hlo; base < hhi; base += 32) {
            const int i = base + lane;
            ce += __popc(__ballot_sync(FULL_MASK, i < hhi && !hit_flag[s_lr[i]]));
        }
        int bhm, be, thm, te;
        warp_offsets(chm, ce, scratch, bhm, be, thm, te);
        nhit = thm >> 16;
        nmiss = thm & 0xffff;
        if (tid == 0) list_base = nmiss ? atomicAdd(&counters[0], nmiss) : 0;
        write_ranks(slot_of, rank_of, klo, khi, bhm >> 16, bhm & 0xffff, lane, lt_mask);
        walk_lru(s_lr, hit_flag, victim, lr, hlo, hhi, be, nmiss, lane, lt_mask);
    }
    __syncthreads();
    HS_STAGE(7)
#else
    // Long path. 0) stage the row in shared memory.
    // (shared arrays up to s_lr start at multiples of 16 B: cap and K*4 ints)
    if ((K & 3) == 0 && ((size_t)tk & 15) == 0) {
        for (int j = tid; j < K / 4; j += T) reinterpret_cast<int4*>(s_tk)[j] = reinterpret_cast<const int4*>(tk)[j];
    } else {
        for (int j = tid; j < K; j += T) s_tk[j] = tk[j];
    }
    if ((H & 3) == 0 && ((size_t)sp & 15) == 0 && ((size_t)lr & 15) == 0) {
        for (int i = tid; i < H / 4; i += T) {
            const int4 a = reinterpret_cast<const int4*>(sp)[i];
            const int4 c = reinterpret_cast<const int4*>(lr)[i];
            reinterpret_cast<int4*>(s_sp)[i] = a;
            reinterpret_cast<int4*>(s_lr)[i] = c;
        }
    } else {
#pragma unroll 4
        for (int i = tid; i < H; i += T) {
            s_sp[i] = sp[i];
            s_lr[i] = lr[i];
        }
    }
    if ((H & 3) == 0) {  // hit_flag starts at a multiple of 4 bytes
        for (int i = tid; i < H / 4; i += T) reinterpret_cast<unsigned*>(hit_flag)[i] = 0u;
    } else {
        for (int i = tid; i < H; i += T) hit_flag[i] = 0;
    }
#pragma unroll 4
    for (int i = tid; i <= H; i += T) s_srow[i] = srow[i];
    for (int i = tid; i < cap / 4; i += T) reinterpret_cast<int4*>(h_keys)[i] = make_int4(-1, -1, -1, -1);
    __syncthreads();
    HS_STAGE(2)
#pragma unroll 4
    for (int j = tid; j < K; j += T) {
        const int p = s_tk[j];
        const int pg = p >= 0 ? p / page_size : 0;
        rank_of[j] = p >= 0 ? rtab[pg] : -1;
        s_host[j] = p >= 0 ? htab[pg] : -1;
    }
    __syncthreads();
    HS_STAGE(3)
    // 1) settle padding / resident / newest; hash the remaining positions.
    const int mask = cap - 1;
    for (int j = tid; j < K; j += T) {
        const int p = s_tk[j];
        reinterpret_cast<int2*>(pl)[j] = make_int2(-1, -1);
        int code = -1;
        if (p < 0) {
            out[j] = -1;
        } else {
            const int blk = rank_of[j];
            if (blk >= 0) {
                out[j] = blk * page_size + p % page_size;
            } else if ((long long)p == n - 1) {
                out[j] = s_srow[H];
            } else {
                code = -2;
                hash_insert(h_keys, h_vals, p, j, hash_bits, mask);
            }
        }
        slot_of[j] = code;
    }
    __syncthreads();
    HS_STAGE(4)
    // 2) mark every hit before any eviction.
    for (int i = tid; i < H; i += T) {
        const int q = s_sp[i];
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
    HS_STAGE(5)
    // 3) ranks of hits and misses in top-k order: warp w owns a contiguous segment of K.
    int nhit, nmiss;
    {
        const int seg = ((K + nwarps * 32 - 1) / (nwarps * 32)) * 32;
        const int lo = warp * seg, hi = min(K, lo + seg);
        int ch = 0, cm = 0;
        for (int base = lo; base < hi; base += 32) {
            const int j = base + lane;
            const int c = j < hi ? slot_of[j] : -1;
            ch += __popc(__ballot_sync(FULL_MASK, c >= 0));
            cm += __popc(__ballot_sync(FULL_MASK, c == -2));
        }
        int bh, bm;
        warp_offsets(ch, cm, scratch, bh, bm, nhit, nmiss);
        for (int base = lo; base < hi; base += 32) {
            const int j = base + lane;
            const int c = j < hi ? slot_of[j] : -1;
            const unsigned hb = __ballot_sync(FULL_MASK, c >= 0);
            const unsigned mb = __ballot_sync(FULL_MASK, c == -2);
            if (c >= 0) rank_of[j] = bh + __popc(hb & lt_mask);
            if (c == -2) rank_of[j] = bm + __popc(mb & lt_mask);
            bh += __popc(hb);
            bm += __popc(mb);
        }
    }
    HS_STAGE(6)
    // 4) walk the LRU (oldest first): the first nmiss non-hit slots are evicted, the others keep
    //    their order at the front of the new LRU (written to global; the old one is staged).
    {
        const int seg = ((H + nwarps * 32 - 1) / (nwarps * 32)) * 32;
        const int lo = warp * seg, hi = min(H, lo + seg);
        int ce = 0;
        for (int base = lo; base < hi; base += 32) {
            const int i = base + lane;
            ce += __popc(__ballot_sync(FULL_MASK, i < hi && !hit_flag[s_lr[i]]));
        }
        int be, unused_b, total_e, unused_t;
        warp_offsets(ce, 0, scratch, be, unused_b, total_e, unused_t);
        for (int base = lo; base < hi; base += 32) {
            const int i = base + lane;
            const int slot = i < hi ? s_lr[i] : 0;
            const bool ev = i < hi && !hit_flag[slot];
            const unsigned eb = __ballot_sync(FULL_MASK, ev);
            if (ev) {
                const int r = be + __popc(eb & lt_mask);
                if (r < nmiss) victim[r] = slot;
                else lr[r - nmiss] = slot;
            }
            be += __popc(eb);
        }
    }
    __syncthreads();
    HS_STAGE(7)
    // 5) tail of the LRU: newly filled, then hits; fill slots, write the plan and the miss list.
#endif
    const int fill0 = H - nhit - nmiss;
    const int hit0 = H - nhit;
#if !HS_FUSED
    __shared__ int list_base;
    if (tid == 0) list_base = nmiss ? atomicAdd(&counters[0], nmiss) : 0;
    __syncthreads();
#endif
    for (int j = tid; j < K; j += T) {
        const int c = slot_of[j];
        if (c >= 0) {
            lr[hit0 + rank_of[j]] = c;
            out[j] = s_srow[c];
        } else if (c == -2) {
            const int p = s_tk[j];
            const int v = victim[rank_of[j]];
            lr[fill0 + rank_of[j]] = v;
            sp[v] = p;
            const int drow = s_srow[v];
            const int hrow = s_host[j] * page_size + p % page_size;
            out[j] = drow;
            pl[2 * j] = hrow;
            pl[2 * j + 1] = drow;
            const int m = list_base + rank_of[j];
            miss_list[2 * m] = hrow;
            miss_list[2 * m + 1] = drow;
        }
    }
}
