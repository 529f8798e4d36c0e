// Phase A over thread-block clusters (ring 2), appended to resolver.cu when the module is built
// (kernels/cuda.py): it uses resolver.cu's FULL_MASK, warp_offsets and hash_pos. Opt-in
// (HISPARSE_RESOLVER_CLUSTER, `cluster=`): measured on the H100 on 2026-12-05 it takes phase A from
// 14.6 to 14.0 us at batch 1 (BENCHMARKS.md "Resolver kernels"): phase A is a chain of dependent
// passes, each a round trip to memory plus a barrier, not a throughput problem. Its rank and
// LRU-walk loops mirror hs_resolve's over a slice; folding both into shared device helpers
// changes hs_resolve, so it waits for a session that can re-run the parity tests on a GPU.

// Phase A spread over a thread-block cluster (sm90): C blocks per batch row, grid = (B * C),
// block = (T). Same contract and bit-identical results as hs_resolve; each block owns a slice of
// the top-k (Ks = ceil(K / C) entries) and a slice of the hot slots (Hs = ceil(H / C)), and the
// blocks meet through distributed shared memory at four cluster barriers:
//   (A) each block staged its slices, classified its top-k slice (-2 miss candidate, -1 settled)
//       and hashed the WHOLE top-k into its own table (every non-newest position: a resident
//       one is filtered out below);
//   (B) each block probed its slots and marked hits with a compare-and-swap (-2 -> slot) on the
//       owning block's classification, so a resident or newest position never counts as a hit;
//   (C) each block sent its hit, miss and evictable counts to every block of the cluster;
//   (D) each block walked its slice of the LRU (global evictable ranks) and sent each victim to
//       the block that owns the miss of that rank.
// After (D) a block touches only its own shared memory and global memory, so it may exit while
// the others finish. Dynamic shared memory: 2*cap + 4*K + Ks + 3*Hs + 3*C + 64 ints, then 2*Hs
// bytes. Each block appends its misses to the compact miss list at its own offset.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ void cluster_sync() {  // also a block barrier; release / acquire
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
                 ::: "memory");
}

template <typename Tp>
__device__ __forceinline__ Tp* in_block(Tp* p, unsigned rank) {  // same variable, block `rank`
    unsigned long long out;
    asm volatile("mapa.u64 %0, %1, %2;" : "=l"(out) : "l"(reinterpret_cast<unsigned long long>(p)),
                 "r"(rank));
    return reinterpret_cast<Tp*>(out);
}

template <int C>
__device__ __forceinline__ void resolve_cluster(
    const int* __restrict__ top_k, int K, const void* __restrict__ seq_lens, int lens64,
    const int* __restrict__ state_idx, int* __restrict__ slot_pos, int* __restrict__ lru, int H,
    const int* __restrict__ slot_rows, const int* __restrict__ resident_table,
    const int* __restrict__ host_table, int P, int page_size, int* __restrict__ out_rows,
    int* __restrict__ plan, int hash_bits, int* __restrict__ miss_list,
    int* __restrict__ counters) {
    extern __shared__ int cl_smem[];  // (the name hs_resolve's `smem` has would clash)
    const unsigned r = cluster_rank();
    const int b = blockIdx.x / C;
    const int tid = threadIdx.x;
    const int T = blockDim.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int nwarps = T >> 5;
    const unsigned lt_mask = (1u << lane) - 1u;
    const int Ks = (K + C - 1) / C, Hs = (H + C - 1) / C;
    const int k_lo = min(K, (int)r * Ks), k_hi = min(K, k_lo + Ks);
    const int h_lo = min(H, (int)r * Hs), h_hi = min(H, h_lo + Hs);
    const long long n = lens64 ? static_cast<const long long*>(seq_lens)[b]
                               : (long long)static_cast<const int*>(seq_lens)[b];
    const int* tk = top_k + (size_t)b * K;
    int* out = out_rows + (size_t)b * K;
    int* pl = plan + (size_t)b * K * 2;
    const int* srow = slot_rows + (size_t)b * (H + 1);
    const int* rtab = resident_table + (size_t)b * P;
    const int* htab = host_table + (size_t)b * P;

    if (n <= 0) {  // padded row (the whole cluster returns here): -1 everywhere
        for (int j = k_lo + tid; j < k_hi; j += T) {
            out[j] = -1;
            reinterpret_cast<int2*>(pl)[j] = make_int2(-1, -1);
        }
        return;
    }
    const int s = state_idx[b];
    int* sp = slot_pos + (size_t)s * H;
    int* lr = lru + (size_t)s * H;
    if (n <= H) {  // short path: slot p holds position p; lookup only
        for (int j = k_lo + tid; j < k_hi; j += T) {
            const int p = tk[j];
            int row = -1;
            if (p >= 0) {
                const int blk = rtab[p / page_size];
                row = blk >= 0 ? blk * page_size + p % page_size : srow[p];
            }
            out[j] = row;
            reinterpret_cast<int2*>(pl)[j] = make_int2(-1, -1);
        }
        for (int i = h_lo + tid; i < min((long long)h_hi, n); i += T) sp[i] = i;
        return;
    }

    const int cap = 1 << hash_bits;
    const int mask = cap - 1;
    int* h_keys = cl_smem;
    int* h_vals = h_keys + cap;
    int* s_tk = h_vals + cap;     // K: the row's whole top-k (every block hashes all of it)
    int* slot_of = s_tk + K;      // K (own slice used): slot of a hit, -2 miss, -1 settled
    int* rank_of = slot_of + K;   // K (own slice): resident block, then rank within the block
    int* s_host = rank_of + K;    // K (own slice): host block of each position's page
    int* victim = s_host + K;     // Ks: victims of this block's misses, by miss rank
    int* s_sp = victim + Ks;      // Hs: slot_pos of the own slots
    int* s_lr = s_sp + Hs;        // Hs: the own slice of the old LRU
    int* s_srow = s_lr + Hs;      // Hs: slot_rows of the own slots (unused: rows read from L2)
    int* cnt = s_srow + Hs;       // 3*C: hits, misses, evictables of every block
    int* scratch = cnt + 3 * C;   // 64
    unsigned char* hit_flag = reinterpret_cast<unsigned char*>(scratch + 64);  // Hs, own slots
    unsigned char* s_ev = hit_flag + Hs;  // Hs: own LRU entries that are evictable
    __shared__ int list_base;
    const int newest_row = srow[H];

    // 0) stage; classify the own top-k slice; hash the whole top-k.
    if ((K & 3) == 0 && ((size_t)tk & 15) == 0) {
        for (int j = tid; j < K / 4; j += T) reinterpret_cast<int4*>(s_tk)[j] = reinterpret_cast<const int4*>(tk)[j];
    } else {
        for (int j = tid; j < K; j += T) s_tk[j] = tk[j];
    }
#pragma unroll 4
    for (int i = tid; i < h_hi - h_lo; i += T) {
        s_sp[i] = sp[h_lo + i];
        s_lr[i] = lr[h_lo + i];
        hit_flag[i] = 0;
    }
    for (int i = tid; i < cap / 4; i += T) reinterpret_cast<int4*>(h_keys)[i] = make_int4(-1, -1, -1, -1);
    for (int j = k_lo + tid; j < k_hi; j += T) {  // independent of s_tk: read tk from global
        const int p = tk[j];
        const int pg = p >= 0 ? p / page_size : 0;
        const int blk = p >= 0 ? rtab[pg] : -1;
        s_host[j] = p >= 0 ? htab[pg] : -1;
        reinterpret_cast<int2*>(pl)[j] = make_int2(-1, -1);
        int code = -1;
        if (p < 0) {
            out[j] = -1;
        } else if (blk >= 0) {
            out[j] = blk * page_size + p % page_size;
        } else if ((long long)p == n - 1) {
            out[j] = newest_row;
        } else {
            code = -2;
        }
        slot_of[j] = code;
    }
    __syncthreads();
    for (int j = tid; j < K; j += T) {
        const int p = s_tk[j];
        if (p < 0 || (long long)p == n - 1) continue;
        hash_insert(h_keys, h_vals, p, j, hash_bits, mask);
    }
    cluster_sync();  // (A)
    // 1) probe the own slots; a hit claims its top-k entry in the owning block.
    for (int i = tid; i < h_hi - h_lo; i += T) {
        const int q = s_sp[i];
        if (q < 0) continue;
        unsigned h = hash_pos(q, hash_bits);
        int key;
        while ((key = h_keys[h]) != -1) {
            if (key == q) {
                const int j = h_vals[h];
                if (atomicCAS(in_block(&slot_of[j], (unsigned)(j / Ks)), -2, h_lo + i) == -2)
                    hit_flag[i] = 1;
                break;
            }
            h = (h + 1) & mask;
        }
    }
    cluster_sync();  // (B)
    // 2) block-local ranks of hits and misses (top-k order) and of evictable LRU entries.
    int bh, bm, th, tm, be, te;
    {
        const int len = k_hi - k_lo;
        const int seg = ((len + nwarps * 32 - 1) / (nwarps * 32)) * 32;
        const int lo = k_lo + warp * seg, hi = min(k_hi, lo + seg);
        int ch = 0, cm = 0;
        for (int base = lo; base < hi; base += 32) {
            const int j = base + lane;
            const int c = j < hi ? slot_of[j] : -1;
            ch += __popc(__ballot_sync(FULL_MASK, c >= 0));
            cm += __popc(__ballot_sync(FULL_MASK, c == -2));
        }
        warp_offsets(ch, cm, scratch, bh, bm, th, tm);
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
    {
        const int len = h_hi - h_lo;
        const int seg = ((len + nwarps * 32 - 1) / (nwarps * 32)) * 32;
        const int lo = warp * seg, hi = min(len, lo + seg);
        int ce = 0;
        for (int base = lo; base < hi; base += 32) {
            const int i = base + lane;
            bool ev = false;
            if (i < hi) {
                const int slot = s_lr[i];
                const int o = slot / Hs;
                ev = !*in_block(&hit_flag[slot - o * Hs], (unsigned)o);
                s_ev[i] = ev;
            }
            ce += __popc(__ballot_sync(FULL_MASK, ev));
        }
        int unused_b, unused_t;
        warp_offsets(ce, 0, scratch, be, unused_b, te, unused_t);
    }
    if (tid < C) {
        int* c = in_block(cnt, (unsigned)tid);
        c[r] = th;
        c[C + r] = tm;
        c[2 * C + r] = te;
    }
    if (tid == 0) list_base = tm ? atomicAdd(&counters[0], tm) : 0;
    cluster_sync();  // (C)
    int hbase = 0, nhit = 0, mbase = 0, nmiss = 0, ebase = 0;
#pragma unroll
    for (int o = 0; o < C; ++o) {
        if (o < (int)r) {
            hbase += cnt[o];
            mbase += cnt[C + o];
            ebase += cnt[2 * C + o];
        }
        nhit += cnt[o];
        nmiss += cnt[C + o];
    }
    // 3) walk the own LRU slice: the first nmiss evictable entries (cluster-wide, LRU order) go
    //    to the blocks owning those misses; the others keep their order at the LRU's front.
    {
        const int len = h_hi - h_lo;
        const int seg = ((len + nwarps * 32 - 1) / (nwarps * 32)) * 32;
        const int lo = warp * seg, hi = min(len, lo + seg);
        int e = ebase + be;
        for (int base = lo; base < hi; base += 32) {
            const int i = base + lane;
            const bool ev = i < hi && s_ev[i];
            const unsigned eb = __ballot_sync(FULL_MASK, ev);
            if (ev) {
                const int rr = e + __popc(eb & lt_mask);
                const int slot = s_lr[i];
                if (rr < nmiss) {
                    int o = 0, m0 = 0;
                    while (rr >= m0 + cnt[C + o]) m0 += cnt[C + o++];
                    *in_block(&victim[rr - m0], (unsigned)o) = slot;
                } else {
                    lr[rr - nmiss] = slot;
                }
            }
            e += __popc(eb);
        }
    }
    cluster_sync();  // (D): no shared memory of another block is touched after this
    // 4) tail of the LRU: newly filled, then hits; fill slots, write the plan and the miss list.
    const int fill0 = H - nhit - nmiss;
    const int hit0 = H - nhit;
    for (int j = k_lo + tid; j < k_hi; j += T) {
        const int c = slot_of[j];
        if (c >= 0) {
            lr[hit0 + hbase + rank_of[j]] = c;
            out[j] = srow[c];
        } else if (c == -2) {
            const int p = s_tk[j];
            const int m = rank_of[j];
            const int v = victim[m];
            lr[fill0 + mbase + m] = v;
            sp[v] = p;
            const int drow = srow[v];
            const int hrow = s_host[j] * page_size + p % page_size;
            out[j] = drow;
            pl[2 * j] = hrow;
            pl[2 * j + 1] = drow;
            miss_list[2 * (list_base + m)] = hrow;
            miss_list[2 * (list_base + m) + 1] = drow;
        }
    }
}

#define HS_RESOLVE_CLUSTER(C)                                                                     \
    extern "C" __global__ void __cluster_dims__(C, 1, 1) hs_resolve_c##C(                         \
        const int* __restrict__ top_k, int K, const void* __restrict__ seq_lens, int lens64,      \
        const int* __restrict__ state_idx, int* __restrict__ slot_pos, int* __restrict__ lru,     \
        int H, const int* __restrict__ slot_rows, const int* __restrict__ resident_table,         \
        const int* __restrict__ host_table, int P, int page_size, int* __restrict__ out_rows,     \
        int* __restrict__ plan, int hash_bits, int* __restrict__ miss_list,                       \
        int* __restrict__ counters) {                                                              \
        resolve_cluster<C>(top_k, K, seq_lens, lens64, state_idx, slot_pos, lru, H, slot_rows,   \
                           resident_table, host_table, P, page_size, out_rows, plan, hash_bits,   \
                           miss_list, counters);                                                  \
    }
HS_RESOLVE_CLUSTER(2)
HS_RESOLVE_CLUSTER(4)
HS_RESOLVE_CLUSTER(8)
#endif  // sm90
