/* Copies between kvstore's token-major KV and vLLM's CPU paged KV cache: the "vec"/"vec16"
ISAs (kvs_vllm_cpu_copy) and the "amx" one (kvs_vllm_amx_copy, at the end of this file).

Built at run time by client/integrations/paged.py (cc -O3 -shared -fPIC) and called through
ctypes, which releases the GIL: paged.py splits the layers over a few threads. Where no C
compiler is found, paged.py copies with torch ops instead (same bytes, about 3x slower).

Inside one (page, head) of a vLLM CPU cache layer `[pages, heads, page_size, 2*head_dim]`, K
is column-major `[head_dim, page_size]` and V row-major `[page_size, head_dim]`
(`reshape_and_cache` in vLLM's csrc/cpu/cpu_attn_vec.hpp). kvstore keeps each of K and V
token-major, `[tokens, heads, head_dim]`, so V moves as rows and K is transposed: 16x16 tiles
of bytes (fp8 caches), 8x8 of 16-bit or 4x4 of 32-bit elements in SSE2 registers, element by
element otherwise.

Both directions walk the token-major side in address order, a strip of tokens of every head at
a time (the 64 bytes of a K page row: 64 tokens of bytes, 32 of 16-bit elements, 16 of 32-bit
ones). Its
token rows are 2-4 KiB apart: walked one head at a time down a page, every row was a new 4 KiB
page for the prefetcher, and even V's plain row copies ran at 0.4x memcpy. A load writes V with
streaming stores (no read of the cache lines it overwrites), and K's strips too, one whole
64-byte line after another from an L1 buffer (`transpose_streaming`); a save does the same into
kvstore's rows. Against the head-by-head walk: loads in 0.78-0.91x the time on one core,
0.81-1.04x on two, saves 0.94-1.01x; K streamed in whole lines: loads in another 0.63-0.84x,
then saves streamed: saves in 0.70-0.87x (`tests/unit/bench_paged_copy.py --against`,
docs/ENGINES.md). Streaming K's tiles' 16-byte pieces as they came was up to 1.7x slower on two
threads (lines left half-written), and AVX2 8x8 tiles for 32-bit K gained nothing over SSE2:
memory, not the shuffles, bounds the transpose. */
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

#if defined(__SSE2__)
/* One tile: dst[c][r] = src[r][c] for r, c < 8 (16-bit) or < 4 (32-bit); strides in elements. */
static inline void tile16x8(const char* s, int64_t ss, char* d, int64_t ds) {
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
    _mm_storeu_si128((__m128i*)(d + 0 * ds * 2), _mm_unpacklo_epi64(c0, c4));
    _mm_storeu_si128((__m128i*)(d + 1 * ds * 2), _mm_unpackhi_epi64(c0, c4));
    _mm_storeu_si128((__m128i*)(d + 2 * ds * 2), _mm_unpacklo_epi64(c1, c5));
    _mm_storeu_si128((__m128i*)(d + 3 * ds * 2), _mm_unpackhi_epi64(c1, c5));
    _mm_storeu_si128((__m128i*)(d + 4 * ds * 2), _mm_unpacklo_epi64(c2, c6));
    _mm_storeu_si128((__m128i*)(d + 5 * ds * 2), _mm_unpackhi_epi64(c2, c6));
    _mm_storeu_si128((__m128i*)(d + 6 * ds * 2), _mm_unpacklo_epi64(c3, c7));
    _mm_storeu_si128((__m128i*)(d + 7 * ds * 2), _mm_unpackhi_epi64(c3, c7));
}

/* One tile of bytes (fp8 caches): dst[c][r] = src[r][c] for r, c < 16, in four rounds of
   unpacks (bytes, then pairs, quads and halves of rows). */
static inline void tile8x16(const char* s, int64_t ss, char* d, int64_t ds) {
    __m128i a[16], b[16];
    for (int i = 0; i < 16; i++)
        a[i] = _mm_loadu_si128((const __m128i*)(s + i * ss));
    for (int p = 0; p < 8; p++) {  /* b[8h + p]: rows 2p, 2p+1 of columns 8h..8h+7 */
        b[p] = _mm_unpacklo_epi8(a[2 * p], a[2 * p + 1]);
        b[8 + p] = _mm_unpackhi_epi8(a[2 * p], a[2 * p + 1]);
    }
    for (int h = 0; h < 2; h++)  /* a[4g + q]: rows 4q..4q+3 of columns 4g..4g+3 */
        for (int q = 0; q < 4; q++) {
            a[8 * h + q] = _mm_unpacklo_epi16(b[8 * h + 2 * q], b[8 * h + 2 * q + 1]);
            a[8 * h + 4 + q] = _mm_unpackhi_epi16(b[8 * h + 2 * q], b[8 * h + 2 * q + 1]);
        }
    for (int g = 0; g < 4; g++)  /* b[2k + w]: rows 8w..8w+7 of columns 2k, 2k+1 */
        for (int w = 0; w < 2; w++) {
            b[4 * g + w] = _mm_unpacklo_epi32(a[4 * g + 2 * w], a[4 * g + 2 * w + 1]);
            b[4 * g + 2 + w] = _mm_unpackhi_epi32(a[4 * g + 2 * w], a[4 * g + 2 * w + 1]);
        }
    for (int k = 0; k < 8; k++) {
        _mm_storeu_si128((__m128i*)(d + (2 * k) * ds), _mm_unpacklo_epi64(b[2 * k], b[2 * k + 1]));
        _mm_storeu_si128((__m128i*)(d + (2 * k + 1) * ds),
                         _mm_unpackhi_epi64(b[2 * k], b[2 * k + 1]));
    }
}

static inline void tile32x4(const char* s, int64_t ss, char* d, int64_t ds) {
    __m128i a0 = _mm_loadu_si128((const __m128i*)(s + 0 * ss * 4));
    __m128i a1 = _mm_loadu_si128((const __m128i*)(s + 1 * ss * 4));
    __m128i a2 = _mm_loadu_si128((const __m128i*)(s + 2 * ss * 4));
    __m128i a3 = _mm_loadu_si128((const __m128i*)(s + 3 * ss * 4));
    __m128i b0 = _mm_unpacklo_epi32(a0, a1), b1 = _mm_unpackhi_epi32(a0, a1);
    __m128i b2 = _mm_unpacklo_epi32(a2, a3), b3 = _mm_unpackhi_epi32(a2, a3);
    _mm_storeu_si128((__m128i*)(d + 0 * ds * 4), _mm_unpacklo_epi64(b0, b2));
    _mm_storeu_si128((__m128i*)(d + 1 * ds * 4), _mm_unpackhi_epi64(b0, b2));
    _mm_storeu_si128((__m128i*)(d + 2 * ds * 4), _mm_unpacklo_epi64(b1, b3));
    _mm_storeu_si128((__m128i*)(d + 3 * ds * 4), _mm_unpackhi_epi64(b1, b3));
}
#endif

/* The tiles of a transpose, along the rows of dst: each gets its bytes one tile after another. */
#define TILES(TILE, T)                                                                       \
    for (int c = 0; c + (T) <= cols; c += (T))                                               \
        for (int r = 0; r + (T) <= rows; r += (T))                                           \
            TILE(src + ((int64_t)r * ss + c) * es, ss, dst + ((int64_t)c * ds + r) * es, ds);

/* dst[c][r] = src[r][c] for a rows x cols matrix of es-byte elements; strides in elements.
   Callers pass one strip of tokens: its rows (a scatter) or its columns (a gather). */
static void transpose(const char* src, int64_t ss, char* dst, int64_t ds, int rows, int cols,
                      int es) {
    int tile = 0;
#if defined(__SSE2__)
    if (es == 1) {
        tile = 16;
        TILES(tile8x16, 16)
    } else if (es == 2) {
        tile = 8;
        TILES(tile16x8, 8)
    } else if (es == 4) {
        tile = 4;
        TILES(tile32x4, 4)
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

/* memcpy, with streaming stores where dst is 16-byte aligned and n a multiple of 64 (the
   caller fences). */
static void copy_streaming(char* dst, const char* src, size_t n) {
#if defined(__SSE2__)
    if (((uintptr_t)dst & 15) == 0 && n % 64 == 0) {
        for (size_t i = 0; i < n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i*)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i*)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i*)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i*)(src + i + 48));
            _mm_stream_si128((__m128i*)(dst + i), a);
            _mm_stream_si128((__m128i*)(dst + i + 16), b);
            _mm_stream_si128((__m128i*)(dst + i + 32), c);
            _mm_stream_si128((__m128i*)(dst + i + 48), d);
        }
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* The body of transpose_streaming, for one element size. */
#if defined(__SSE2__)
static inline __attribute__((always_inline)) void streamed_tiles(
    const char* src, int64_t ss, char* dst, int64_t ds, int rows, int cols, int es) {
    const int t = es == 1 ? 16 : es == 2 ? 8 : 4, line = 64 / es;  /* tile; elements a line */
    _Alignas(64) char lines[16 * 64];
    for (int c = 0; c + t <= cols; c += t) {
        for (int r0 = 0; r0 < rows; r0 += line) {
            for (int q = 0; q < 4; q++) {
                const char* s = src + ((int64_t)(r0 + q * t) * ss + c) * es;
                if (es == 1)
                    tile8x16(s, ss, lines + q * 16, 64);
                else if (es == 2)
                    tile16x8(s, ss, lines + q * 16, 32);
                else
                    tile32x4(s, ss, lines + q * 16, 16);
            }
            for (int j = 0; j < t; j++) {
                __m128i* d = (__m128i*)(dst + ((int64_t)(c + j) * ds + r0) * es);
                const __m128i* b = (const __m128i*)(lines + j * 64);
                _mm_stream_si128(d, b[0]);
                _mm_stream_si128(d + 1, b[1]);
                _mm_stream_si128(d + 2, b[2]);
                _mm_stream_si128(d + 3, b[3]);
            }
        }
    }
    transpose_scalar(src, ss, dst, ds, 0, rows, cols / t * t, cols, es);  /* columns past */
}
#endif

/* transpose() with streaming stores, for dst rows that get whole 64-byte lines: dst[c][r] =
   src[r][c], rows a multiple of 64 / es. Each group of four tiles along r fills its dst rows'
   lines in an L1 buffer, which is then streamed out one line after another: no read of the
   lines it overwrites, and no line left half-written in the write-combining buffers
   (streaming the tiles' 16-byte pieces as they came was up to 1.7x slower on two threads).
   Returns 0, having copied nothing, where that does not apply (dst or its row stride not
   16-byte aligned, rows not whole lines, no SSE2 tile for es). */
static int transpose_streaming(const char* src, int64_t ss, char* dst, int64_t ds, int rows,
                               int cols, int es) {
#if defined(__SSE2__)
    if (((uintptr_t)dst & 15) || (ds * es) % 16 || (es != 1 && es != 2 && es != 4)
            || (rows * es) % 64)
        return 0;
    if (es == 1)  /* a constant element size per call: the tiles' loops unroll */
        streamed_tiles(src, ss, dst, ds, rows, cols, 1);
    else if (es == 2)
        streamed_tiles(src, ss, dst, ds, rows, cols, 2);
    else
        streamed_tiles(src, ss, dst, ds, rows, cols, 4);
    return 1;
#else
    (void)src; (void)ss; (void)dst; (void)ds; (void)rows; (void)cols; (void)es;
    return 0;
#endif
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
    const size_t row = (size_t)dim * es;
    const int strip = 64 / es;  /* tokens per strip: a whole 64-byte line of a K page row */
    for (int l = l0; l < l1; l++) {
        for (int i = 0; i < npages; i++) {
            const int n = ntok ? ntok[i] : ps;
            char* k = (char*)src[i] + l * layer_stride * es;
            char* v = k + kv_stride * es;
            char* page = (char*)layers[l] + pages[i] * page_elems * es;
            for (int t0 = 0; t0 < n; t0 += strip) {
                const int rn = n - t0 < strip ? n - t0 : strip;
                for (int h = 0; h < heads; h++) {
                    char* ck = page + (int64_t)(head0 + h) * 2 * ps * dim * es + (int64_t)t0 * es;
                    char* sk = k + ((int64_t)t0 * hd + (int64_t)h * dim) * es;
                    if (gather) {
                        if (!transpose_streaming(ck, ps, sk, hd, dim, rn, es))
                            transpose(ck, ps, sk, hd, dim, rn, es);
                    } else if (!transpose_streaming(sk, hd, ck, ps, rn, dim, es)) {
                        transpose(sk, hd, ck, ps, rn, dim, es);
                    }
                }
            }
            for (int t = 0; t < n; t++) {
                for (int h = 0; h < heads; h++) {
                    char* cv = page + ((int64_t)(head0 + h) * 2 * ps + ps + t) * dim * es;
                    char* sv = v + ((int64_t)t * hd + (int64_t)h * dim) * es;
                    if (!gather)
                        copy_streaming(cv, sv, row);
                    else
                        copy_streaming(sv, cv, row);
                }
            }
        }
    }
#if defined(__SSE2__)
    _mm_sfence();  /* streaming stores are visible to the caller's readers from here on */
#endif
}

/* ---- vLLM's "amx" ISA (2-byte elements; bf16 on CPUs with AMX tiles).

Inside one (page, head), K is `[ps/16, dim/2, 16, 2]`: each block of 16 tokens holds the
transpose of its `[16, dim/2]` pairs of dims, so K moves as a transpose of 32-bit elements (a
pair each) into rows of 16, one whole 64-byte line per pair. V is `[dim/16, ps/2, 16, 2]`: each
64-byte line holds 16 dims of two adjacent tokens, interleaved (`cpu_attn_reshape_and_cache` in
vLLM's csrc/cpu/cpu_attn_amx.hpp). The torch twin of this routine is paged.py's `_amx_scatter`
/ `_amx_gather`: it puts each plane in tile order in a buffer first, and took 4.5-6.5x this
routine's time for 2k-8k tokens of an 8B shape (`tests/unit/bench_paged_copy.py --isa amx
--torch`, 2026-11-29: loads 155 / 578 ms against 27 / 90 ms, saves 109 / 415 ms against 24 /
84 ms). */

/* One line of V: 16 2-byte elements of row a and of row b as pairs (a0 b0 a1 b1 ...). */
static inline void pairs_line(const char* a, const char* b, char* d, int stream) {
#if defined(__SSE2__)
    __m128i a0 = _mm_loadu_si128((const __m128i*)a), a1 = _mm_loadu_si128((const __m128i*)(a + 16));
    __m128i b0 = _mm_loadu_si128((const __m128i*)b), b1 = _mm_loadu_si128((const __m128i*)(b + 16));
    __m128i o0 = _mm_unpacklo_epi16(a0, b0), o1 = _mm_unpackhi_epi16(a0, b0);
    __m128i o2 = _mm_unpacklo_epi16(a1, b1), o3 = _mm_unpackhi_epi16(a1, b1);
    if (stream) {
        _mm_stream_si128((__m128i*)d, o0);
        _mm_stream_si128((__m128i*)(d + 16), o1);
        _mm_stream_si128((__m128i*)(d + 32), o2);
        _mm_stream_si128((__m128i*)(d + 48), o3);
    } else {
        _mm_storeu_si128((__m128i*)d, o0);
        _mm_storeu_si128((__m128i*)(d + 16), o1);
        _mm_storeu_si128((__m128i*)(d + 32), o2);
        _mm_storeu_si128((__m128i*)(d + 48), o3);
    }
#else
    (void)stream;
    for (int j = 0; j < 16; j++) {
        memcpy(d + 4 * j, a + 2 * j, 2);
        memcpy(d + 4 * j + 2, b + 2 * j, 2);
    }
#endif
}

#if defined(__SSE2__)
/* The 8 pairs of x as [a0 a1 a2 a3 b0 b1 b2 b3]. */
static inline __m128i unpair4(__m128i x) {
    x = _mm_shufflelo_epi16(x, _MM_SHUFFLE(3, 1, 2, 0));  /* a0 a1 b0 b1 | a2 b2 a3 b3 */
    x = _mm_shufflehi_epi16(x, _MM_SHUFFLE(3, 1, 2, 0));  /* a0 a1 b0 b1 | a2 a3 b2 b3 */
    return _mm_shuffle_epi32(x, _MM_SHUFFLE(3, 1, 2, 0));
}
#endif

/* The inverse of pairs_line: a line of pairs into 16 elements of row a and of row b. */
static inline void unpair_line(const char* s, char* a, char* b) {
#if defined(__SSE2__)
    __m128i x0 = unpair4(_mm_loadu_si128((const __m128i*)s));
    __m128i x1 = unpair4(_mm_loadu_si128((const __m128i*)(s + 16)));
    __m128i x2 = unpair4(_mm_loadu_si128((const __m128i*)(s + 32)));
    __m128i x3 = unpair4(_mm_loadu_si128((const __m128i*)(s + 48)));
    _mm_storeu_si128((__m128i*)a, _mm_unpacklo_epi64(x0, x1));
    _mm_storeu_si128((__m128i*)b, _mm_unpackhi_epi64(x0, x1));
    _mm_storeu_si128((__m128i*)(a + 16), _mm_unpacklo_epi64(x2, x3));
    _mm_storeu_si128((__m128i*)(b + 16), _mm_unpackhi_epi64(x2, x3));
#else
    for (int j = 0; j < 16; j++) {
        memcpy(a + 2 * j, s + 4 * j, 2);
        memcpy(b + 2 * j, s + 4 * j + 2, 2);
    }
#endif
}

/* kvs_vllm_cpu_copy's twin for an "amx" cache: the same arguments (es must be 2; dim a
   multiple of 16 and at most AMX_MAX_DIM, ps a multiple of 16: the caller checks). The
   token-major side is walked in address order, 16 tokens at a time: their K (every head),
   then their V two tokens at a time. A load streams whole lines into the cache (K's rows of
   16 pairs, V's lines of pairs); a save streams whole token rows, V's through an L1 buffer. */
#define AMX_MAX_DIM 512
void kvs_vllm_amx_copy(int gather, int es, int npages, const int64_t* src, const int64_t* pages,
                       const int32_t* ntok, const int64_t* layers, int l0, int l1,
                       int64_t layer_stride, int64_t kv_stride, int heads, int dim, int ps,
                       int cache_heads, int head0) {
    (void)es;
    const int64_t hd = (int64_t)heads * dim, row = hd * 2;         /* token rows, in bytes */
    const int64_t plane = (int64_t)ps * dim * 2;                   /* K or V of a (page, head) */
    const int64_t page_bytes = (int64_t)cache_heads * 2 * plane;
    const int64_t vstep = (int64_t)ps / 2 * 64;                    /* V: 16 dims further on */
    _Alignas(64) char rows[2][AMX_MAX_DIM * 2];
    for (int l = l0; l < l1; l++) {
        for (int i = 0; i < npages; i++) {
            const int n = ntok ? ntok[i] : ps;
            char* k = (char*)src[i] + l * layer_stride * 2;
            char* v = k + kv_stride * 2;
            char* page = (char*)layers[l] + pages[i] * page_bytes;
            for (int t0 = 0; t0 < n; t0 += 16) {
                const int rn = n - t0 < 16 ? n - t0 : 16;
                for (int h = 0; h < heads; h++) {
                    /* block t0/16 of K: dim/2 rows of 16 pairs */
                    char* ck = page + (int64_t)(head0 + h) * 2 * plane + (int64_t)t0 * dim * 2;
                    char* sk = k + t0 * row + (int64_t)h * dim * 2;
                    if (gather) {
                        if (!transpose_streaming(ck, 16, sk, hd / 2, dim / 2, rn, 4))
                            transpose(ck, 16, sk, hd / 2, dim / 2, rn, 4);
                    } else if (!transpose_streaming(sk, hd / 2, ck, 16, rn, dim / 2, 4)) {
                        transpose(sk, hd / 2, ck, 16, rn, dim / 2, 4);
                    }
                }
                for (int t = t0; t < t0 + rn; t += 2) {
                    const int pair = t + 1 < n;  /* else the page's last token, alone */
                    for (int h = 0; h < heads; h++) {
                        char* cv = page + (int64_t)(head0 + h) * 2 * plane + plane + t / 2 * 64;
                        char* a = v + t * row + (int64_t)h * dim * 2;
                        char* b = a + row;
                        const int stream = ((uintptr_t)cv & 15) == 0;
                        for (int d = 0; d < dim; d += 16) {
                            char* line = cv + d / 16 * vstep;
                            if (!pair) {
                                for (int j = 0; j < 16; j++)
                                    memcpy(gather ? a + (d + j) * 2 : line + 4 * j,
                                           gather ? line + 4 * j : a + (d + j) * 2, 2);
                            } else if (gather) {
                                unpair_line(line, rows[0] + d * 2, rows[1] + d * 2);
                            } else {
                                pairs_line(a + d * 2, b + d * 2, line, stream);
                            }
                        }
                        if (gather && pair) {
                            copy_streaming(a, rows[0], (size_t)dim * 2);
                            copy_streaming(b, rows[1], (size_t)dim * 2);
                        }
                    }
                }
            }
        }
    }
#if defined(__SSE2__)
    _mm_sfence();
#endif
}
