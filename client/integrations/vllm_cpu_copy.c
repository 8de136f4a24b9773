/* Copies between kvstore's token-major KV and vLLM's CPU paged KV cache ("vec"/"vec16" ISAs).

Built at run time by client/integrations/paged.py (cc -O3 -shared -fPIC) and called through
ctypes, which releases the GIL: paged.py splits the layers over a few threads. Where no C
compiler is found, paged.py copies with torch ops instead (same bytes, about 3x slower).

Inside one (page, head) of a vLLM CPU cache layer `[pages, heads, page_size, 2*head_dim]`, K
is column-major `[head_dim, page_size]` and V row-major `[page_size, head_dim]`
(`reshape_and_cache` in vLLM's csrc/cpu/cpu_attn_vec.hpp). kvstore keeps each of K and V
token-major, `[tokens, heads, head_dim]`, so V moves as rows and K is transposed: 8x8 tiles of
16-bit or 4x4 tiles of 32-bit elements in SSE2 registers, element by element otherwise. */
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static void transpose_scalar(const char* src, int64_t ss, char* dst, int64_t ds, int r0, int r1,
                             int c0, int c1, int es) {
    for (int r = r0; r < r1; r++)
        for (int c = c0; c < c1; c++)
            memcpy(dst + ((int64_t)c * ds + r) * es, src + ((int64_t)r * ss + c) * es, es);
}

/* dst[c][r] = src[r][c] for a rows x cols matrix of es-byte elements; strides in elements.

   Tiles go along the rows of src, or with by_dst along the rows of dst. The token-major side
   has rows heads*dim elements apart (2-4 KiB: rows 4 KiB apart share one L1 set), so it should
   be the side whose rows are finished one after the other: a scatter reads each token row
   once, a gather (by_dst) fills each token row with whole cache lines. A gather that went
   along the page's rows instead wrote 16 bytes into each of a page's token rows at a time: 1.6x
   the time of the scatter in float32. */
static void transpose(const char* src, int64_t ss, char* dst, int64_t ds, int rows, int cols,
                      int es, int by_dst) {
    int tile = 0;
    const int outer = by_dst ? cols : rows, inner = by_dst ? rows : cols;
#if defined(__SSE2__)
    if (es == 2) {
        tile = 8;
        for (int o = 0; o + 8 <= outer; o += 8) {
            for (int i = 0; i + 8 <= inner; i += 8) {
                const int r = by_dst ? i : o, c = by_dst ? o : i;
                const char* s = src + ((int64_t)r * ss + c) * 2;
                __m128i a0 = _mm_loadu_si128((const __m128i*)(s + 0 * ss * 2));
                __m128i a1 = _mm_loadu_si128((const __m128i*)(s + 1 * ss * 2));
                __m128i a2 = _mm_loadu_si128((const __m128i*)(s + 2 * ss * 2));
                __m128i a3 = _mm_loadu_si128((const __m128i*)(s + 3 * ss * 2));
                __m128i a4 = _mm_loadu_si128((const __m128i*)(s + 4 * ss * 2));
                __m128i a5 = _mm_loadu_si128((const __m128i*)(s + 5 * ss * 2));
                __m128i a6 = _mm_loadu_si128((const __m128i*)(s + 6 * ss * 2));
                __m128i a7 = _mm_loadu_si128((const __m128i*)(s + 7 * ss * 2));
                __m128i b0 = _mm_unpacklo_epi16(a0, a1), b1 = _mm_unpackhi_epi16(a0, a1);
                __m128i b2 = _mm_unpacklo_epi16(a2, a3), b3 = _mm_unpackhi_epi16(a2, a3);
                __m128i b4 = _mm_unpacklo_epi16(a4, a5), b5 = _mm_unpackhi_epi16(a4, a5);
                __m128i b6 = _mm_unpacklo_epi16(a6, a7), b7 = _mm_unpackhi_epi16(a6, a7);
                __m128i c0 = _mm_unpacklo_epi32(b0, b2), c1 = _mm_unpackhi_epi32(b0, b2);
                __m128i c2 = _mm_unpacklo_epi32(b1, b3), c3 = _mm_unpackhi_epi32(b1, b3);
                __m128i c4 = _mm_unpacklo_epi32(b4, b6), c5 = _mm_unpackhi_epi32(b4, b6);
                __m128i c6 = _mm_unpacklo_epi32(b5, b7), c7 = _mm_unpackhi_epi32(b5, b7);
                char* d = dst + ((int64_t)c * ds + r) * 2;
                _mm_storeu_si128((__m128i*)(d + 0 * ds * 2), _mm_unpacklo_epi64(c0, c4));
                _mm_storeu_si128((__m128i*)(d + 1 * ds * 2), _mm_unpackhi_epi64(c0, c4));
                _mm_storeu_si128((__m128i*)(d + 2 * ds * 2), _mm_unpacklo_epi64(c1, c5));
                _mm_storeu_si128((__m128i*)(d + 3 * ds * 2), _mm_unpackhi_epi64(c1, c5));
                _mm_storeu_si128((__m128i*)(d + 4 * ds * 2), _mm_unpacklo_epi64(c2, c6));
                _mm_storeu_si128((__m128i*)(d + 5 * ds * 2), _mm_unpackhi_epi64(c2, c6));
                _mm_storeu_si128((__m128i*)(d + 6 * ds * 2), _mm_unpacklo_epi64(c3, c7));
                _mm_storeu_si128((__m128i*)(d + 7 * ds * 2), _mm_unpackhi_epi64(c3, c7));
            }
        }
    } else if (es == 4) {
        tile = 4;
        for (int o = 0; o + 4 <= outer; o += 4) {
            for (int i = 0; i + 4 <= inner; i += 4) {
                const int r = by_dst ? i : o, c = by_dst ? o : i;
                const char* s = src + ((int64_t)r * ss + c) * 4;
                __m128i a0 = _mm_loadu_si128((const __m128i*)(s + 0 * ss * 4));
                __m128i a1 = _mm_loadu_si128((const __m128i*)(s + 1 * ss * 4));
                __m128i a2 = _mm_loadu_si128((const __m128i*)(s + 2 * ss * 4));
                __m128i a3 = _mm_loadu_si128((const __m128i*)(s + 3 * ss * 4));
                __m128i b0 = _mm_unpacklo_epi32(a0, a1), b1 = _mm_unpackhi_epi32(a0, a1);
                __m128i b2 = _mm_unpacklo_epi32(a2, a3), b3 = _mm_unpackhi_epi32(a2, a3);
                char* d = dst + ((int64_t)c * ds + r) * 4;
                _mm_storeu_si128((__m128i*)(d + 0 * ds * 4), _mm_unpacklo_epi64(b0, b2));
                _mm_storeu_si128((__m128i*)(d + 1 * ds * 4), _mm_unpackhi_epi64(b0, b2));
                _mm_storeu_si128((__m128i*)(d + 2 * ds * 4), _mm_unpacklo_epi64(b1, b3));
                _mm_storeu_si128((__m128i*)(d + 3 * ds * 4), _mm_unpackhi_epi64(b1, b3));
            }
        }
    }
#endif
    if (tile == 0) {  /* element by element, in 16x16 blocks for the caches */
        for (int r0 = 0; r0 < rows; r0 += 16)
            for (int c0 = 0; c0 < cols; c0 += 16)
                transpose_scalar(src, ss, dst, ds, r0, r0 + 16 < rows ? r0 + 16 : rows, c0,
                                 c0 + 16 < cols ? c0 + 16 : cols, es);
        return;
    }
    int rt = rows / tile * tile, ct = cols / tile * tile;
    transpose_scalar(src, ss, dst, ds, rt, rows, 0, cols, es);  /* rows past the tiles */
    transpose_scalar(src, ss, dst, ds, 0, rt, ct, cols, es);    /* columns past the tiles */
}

/* Copy `npages` pages between token-major KV and one vLLM CPU cache.

   gather == 0 writes the cache from the KV, gather == 1 the KV from the cache. For page i,
   src[i] is the address of its first token's K in layer 0 of the token-major KV: layer l's K
   rows are at src[i] + l*layer_stride elements, its V rows kv_stride elements further; within
   a plane, tokens are heads*dim elements apart and heads dim apart. pages[i] is the page's
   index in each cache layer, ntok[i] how many of its first tokens to copy (all ps when ntok
   is NULL); layers[l] the address of layer l's cache tensor, whose pages hold cache_heads
   heads, of which heads [head0, head0 + heads) are copied (a slice: blocks stored per KV
   head, shared across tensor-parallel degrees). Layers [l0, l1) are copied; es is the
   element size in bytes. The caller checks every bound. */
void kvs_vllm_cpu_copy(int gather, int es, int npages, const int64_t* src, const int64_t* pages,
                       const int32_t* ntok, const int64_t* layers, int l0, int l1,
                       int64_t layer_stride, int64_t kv_stride, int heads, int dim, int ps,
                       int cache_heads, int head0) {
    const int64_t hd = (int64_t)heads * dim, page_elems = (int64_t)cache_heads * dim * 2 * ps;
    for (int l = l0; l < l1; l++) {
        for (int i = 0; i < npages; i++) {
            const int n = ntok ? ntok[i] : ps;
            char* k = (char*)src[i] + l * layer_stride * es;
            char* v = k + kv_stride * es;
            char* page = (char*)layers[l] + pages[i] * page_elems * es;
            for (int h = 0; h < heads; h++) {
                char* ck = page + (int64_t)(head0 + h) * 2 * ps * dim * es;
                char* cv = ck + (int64_t)ps * dim * es;
                char* sk = k + (int64_t)h * dim * es;
                char* sv = v + (int64_t)h * dim * es;
                if (!gather) {
                    transpose(sk, hd, ck, ps, n, dim, es, 0);
                    for (int t = 0; t < n; t++)
                        memcpy(cv + (int64_t)t * dim * es, sv + (int64_t)t * hd * es,
                               (size_t)dim * es);
                } else {
                    transpose(ck, ps, sk, hd, dim, n, es, 1);
                    for (int t = 0; t < n; t++)
                        memcpy(sv + (int64_t)t * hd * es, cv + (int64_t)t * dim * es,
                               (size_t)dim * es);
                }
            }
        }
    }
}
