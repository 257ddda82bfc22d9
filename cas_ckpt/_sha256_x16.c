/* SHA-256 of 16 buffers at once, one buffer per 32-bit lane of AVX-512 registers.
 *
 * OpenSSL hashes one buffer at a time with the SHA extensions (1.6 GiB/s on the Zen 4 VM the
 * figures in docs/performance.md come from). The rounds of one buffer depend on each other;
 * sixteen independent buffers do not, and one AVX-512 instruction runs a round step for all of
 * them: 2.7 GiB/s there. A save's chunks and a load's blocks are mostly buffers of one length
 * (1 MiB), which x16_blocks and x16_final take: 16 buffers of equal length (a lane may repeat
 * another's pointer; its digest is then simply not used). Small arrays are short buffers of
 * all lengths: x16_many gives each lane its own, and a lane done with one takes the next.
 * The digests are SHA-256's, byte for byte: tests/test_hashpool.py compares them with hashlib
 * over every length of padding.
 *
 * Built for any x86-64 (the AVX-512 code is compiled for that target alone) and used only where
 * the CPU and OS support it (x16_available); elsewhere the pool hashes with OpenSSL as before.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "_sha256_x16.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

static const uint32_t K256[64] = {
0x428a2f98,0x71374491,0xb5c0fbcf,0xe9b5dba5,0x3956c25b,0x59f111f1,0x923f82a4,0xab1c5ed5,
0xd807aa98,0x12835b01,0x243185be,0x550c7dc3,0x72be5d74,0x80deb1fe,0x9bdc06a7,0xc19bf174,
0xe49b69c1,0xefbe4786,0x0fc19dc6,0x240ca1cc,0x2de92c6f,0x4a7484aa,0x5cb0a9dc,0x76f988da,
0x983e5152,0xa831c66d,0xb00327c8,0xbf597fc7,0xc6e00bf3,0xd5a79147,0x06ca6351,0x14292967,
0x27b70a85,0x2e1b2138,0x4d2c6dfc,0x53380d13,0x650a7354,0x766a0abb,0x81c2c92e,0x92722c85,
0xa2bfe8a1,0xa81a664b,0xc24b8b70,0xc76c51a3,0xd192e819,0xd6990624,0xf40e3585,0x106aa070,
0x19a4c116,0x1e376c08,0x2748774c,0x34b0bcb5,0x391c0cb3,0x4ed8aa4a,0x5b9cca4f,0x682e6ff3,
0x748f82ee,0x78a5636f,0x84c87814,0x8cc70208,0x90befffa,0xa4506ceb,0xbef9a3f7,0xc67178f2};
static const uint32_t H0[8] = {0x6a09e667,0xbb67ae85,0x3c6ef372,0xa54ff53a,0x510e527f,0x9b05688c,0x1f83d9ab,0x5be0cd19};

#define T __attribute__((target("avx512f,avx512bw")))
#define ROR _mm512_ror_epi32
#define ADD _mm512_add_epi32
#define X3(a,b,c) _mm512_ternarylogic_epi32(a,b,c,0x96)

T static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    _Pragma("GCC unroll 16")
    for (int i = 0; i < 16; i += 2) { t[i] = _mm512_unpacklo_epi32(r[i], r[i+1]); t[i+1] = _mm512_unpackhi_epi32(r[i], r[i+1]); }
    _Pragma("GCC unroll 16")
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i+2]); r[i+1] = _mm512_unpackhi_epi64(t[i], t[i+2]);
        r[i+2] = _mm512_unpacklo_epi64(t[i+1], t[i+3]); r[i+3] = _mm512_unpackhi_epi64(t[i+1], t[i+3]);
    }
    _Pragma("GCC unroll 16")
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i+4], 0x88); t[i+4] = _mm512_shuffle_i32x4(r[i], r[i+4], 0xdd);
        t[i+8] = _mm512_shuffle_i32x4(r[i+8], r[i+12], 0x88); t[i+12] = _mm512_shuffle_i32x4(r[i+8], r[i+12], 0xdd);
    }
    _Pragma("GCC unroll 16")
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i+8], 0x88); r[i+8] = _mm512_shuffle_i32x4(t[i], t[i+8], 0xdd);
    }
}

/* `nblocks` 64-byte blocks of each lane, from p[j] + off. */
T static void blocks16(__m512i s[8], const uint8_t *const p[16], size_t off, size_t nblocks) {
    const __m512i bswap = _mm512_set_epi8(
        60,61,62,63,56,57,58,59,52,53,54,55,48,49,50,51,44,45,46,47,40,41,42,43,36,37,38,39,32,33,34,35,
        28,29,30,31,24,25,26,27,20,21,22,23,16,17,18,19,12,13,14,15,8,9,10,11,4,5,6,7,0,1,2,3);
    for (size_t blk = 0; blk < nblocks; blk++, off += 64) {
        __m512i w[16];
        _Pragma("GCC unroll 16")
        for (int j = 0; j < 16; j++) w[j] = _mm512_loadu_si512((const void *)(p[j] + off));
        transpose16(w);
        _Pragma("GCC unroll 16")
        for (int j = 0; j < 16; j++) w[j] = _mm512_shuffle_epi8(w[j], bswap);
        __m512i a = s[0], b = s[1], c = s[2], d = s[3], e = s[4], f = s[5], g = s[6], h = s[7];
        _Pragma("GCC unroll 64")
        for (int t = 0; t < 64; t++) {
            __m512i wt;
            if (t < 16) wt = w[t];
            else {
                __m512i w15 = w[(t - 15) & 15], w2 = w[(t - 2) & 15];
                __m512i s0 = X3(ROR(w15, 7), ROR(w15, 18), _mm512_srli_epi32(w15, 3));
                __m512i s1 = X3(ROR(w2, 17), ROR(w2, 19), _mm512_srli_epi32(w2, 10));
                wt = ADD(ADD(w[t & 15], s0), ADD(w[(t - 7) & 15], s1));
                w[t & 15] = wt;
            }
            __m512i t1 = ADD(ADD(h, X3(ROR(e, 6), ROR(e, 11), ROR(e, 25))),
                             ADD(_mm512_ternarylogic_epi32(e, f, g, 0xCA), ADD(wt, _mm512_set1_epi32((int)K256[t]))));
            __m512i t2 = ADD(X3(ROR(a, 2), ROR(a, 13), ROR(a, 22)), _mm512_ternarylogic_epi32(a, b, c, 0xE8));
            h = g; g = f; f = e; e = ADD(d, t1); d = c; c = b; b = a; a = ADD(t1, t2);
        }
        s[0] = ADD(s[0], a); s[1] = ADD(s[1], b); s[2] = ADD(s[2], c); s[3] = ADD(s[3], d);
        s[4] = ADD(s[4], e); s[5] = ADD(s[5], f); s[6] = ADD(s[6], g); s[7] = ADD(s[7], h);
    }
}


int x16_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}

T void x16_init(X16State *state) {
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < X16_LANES; j++) state->h[i][j] = H0[i];
}

T void x16_blocks(X16State *state, const unsigned char *const p[X16_LANES], size_t off, size_t nblocks) {
    __m512i s[8];
    for (int i = 0; i < 8; i++) s[i] = _mm512_loadu_si512((const void *)state->h[i]);
    blocks16(s, (const uint8_t *const *)p, off, nblocks);
    for (int i = 0; i < 8; i++) _mm512_storeu_si512((void *)state->h[i], s[i]);
}

/* The padding and length of each lane's last (len % 64) bytes, after its len / 64 blocks. */
T void x16_final(X16State *state, const unsigned char *const p[X16_LANES], size_t len,
                 unsigned char *const out[X16_LANES]) {
    size_t full = len / 64, rem = len % 64, tail = rem < 56 ? 64 : 128;
    uint64_t bits = (uint64_t)len * 8;
    uint8_t pad[X16_LANES][128];
    const unsigned char *q[X16_LANES];
    for (int j = 0; j < X16_LANES; j++) {
        memcpy(pad[j], p[j] + full * 64, rem);
        pad[j][rem] = 0x80;
        memset(pad[j] + rem + 1, 0, tail - rem - 1 - 8);
        for (int k = 0; k < 8; k++) pad[j][tail - 1 - k] = (uint8_t)(bits >> (8 * k));
        q[j] = pad[j];
    }
    x16_blocks(state, q, 0, tail / 64);
    for (int j = 0; j < X16_LANES; j++)
        if (out[j] != NULL)
            for (int i = 0; i < 8; i++) {
                uint32_t v = state->h[i][j];
                out[j][4 * i] = (unsigned char)(v >> 24);
                out[j][4 * i + 1] = (unsigned char)(v >> 16);
                out[j][4 * i + 2] = (unsigned char)(v >> 8);
                out[j][4 * i + 3] = (unsigned char)v;
            }
}

/* A lane of x16_many: the blocks it hashes next, from its buffer and then from its padding. */
typedef struct {
    const unsigned char *at; /* the next block */
    size_t left;             /* blocks from `at` before the segment ends */
    size_t buffer;           /* which of the buffers (its place in `order`) */
    int padding;             /* `at` points into pad: the buffer's last blocks */
    uint8_t pad[128];
} Lane;

/* Lane j of `state` back to SHA-256's start, to hash buffer `order[next]` from its first block. */
static void lane_start(X16State *state, Lane *lane, int j, const unsigned char *const *p,
                       const size_t *len, const size_t *order, size_t next) {
    for (int i = 0; i < 8; i++) state->h[i][j] = H0[i];
    lane->buffer = next;
    lane->at = p[order[next]];
    lane->left = len[order[next]] / 64;
    lane->padding = 0;
}

/* Point the lane at its buffer's last (len % 64) bytes, padded, with the length: 1 or 2 blocks. */
static void lane_pad(Lane *lane, const unsigned char *buf, size_t len) {
    size_t rem = len % 64, tail = rem < 56 ? 64 : 128;
    uint64_t bits = (uint64_t)len * 8;
    memcpy(lane->pad, buf + len / 64 * 64, rem);
    lane->pad[rem] = 0x80;
    memset(lane->pad + rem + 1, 0, tail - rem - 1 - 8);
    for (int k = 0; k < 8; k++) lane->pad[tail - 1 - k] = (uint8_t)(bits >> (8 * k));
    lane->at = lane->pad;
    lane->left = tail / 64;
    lane->padding = 1;
}

static void lane_digest(const X16State *state, int j, unsigned char *out) {
    for (int i = 0; i < 8; i++) {
        uint32_t v = state->h[i][j];
        out[4 * i] = (unsigned char)(v >> 24);
        out[4 * i + 1] = (unsigned char)(v >> 16);
        out[4 * i + 2] = (unsigned char)(v >> 8);
        out[4 * i + 3] = (unsigned char)v;
    }
}

T void x16_many(const unsigned char *const *p, const size_t *len, const size_t *order, size_t n,
                unsigned char *const *out, void (*started)(void *, size_t), void *arg) {
    X16State state;
    Lane lanes[X16_LANES];
    int active[X16_LANES], busy = 0;
    size_t next = 0;
    for (int j = 0; j < X16_LANES; j++) active[j] = 0;
    for (;;) {
        /* Lanes at the end of a segment move on: to the padding, to the next buffer, or idle. */
        for (int j = 0; j < X16_LANES; j++) {
            Lane *lane = &lanes[j];
            while (!active[j] || lane->left == 0) {
                if (active[j] && !lane->padding) {
                    size_t b = order[lane->buffer];
                    lane_pad(lane, p[b], len[b]);
                    continue;
                }
                if (active[j]) { lane_digest(&state, j, out[order[lane->buffer]]); active[j] = 0; busy--; }
                if (next == n) break;
                if (started != NULL) started(arg, order[next]);
                lane_start(&state, lane, j, p, len, order, next++);
                active[j] = 1;
                busy++;
            }
        }
        if (busy == 0) return;
        size_t steps = SIZE_MAX;
        const unsigned char *spare = NULL; /* an idle lane hashes a busy one's blocks, unused */
        for (int j = 0; j < X16_LANES; j++)
            if (active[j]) {
                if (lanes[j].left < steps) steps = lanes[j].left;
                spare = lanes[j].at;
            }
        const unsigned char *at[X16_LANES];
        for (int j = 0; j < X16_LANES; j++) at[j] = active[j] ? lanes[j].at : spare;
        x16_blocks(&state, at, 0, steps);
        for (int j = 0; j < X16_LANES; j++)
            if (active[j]) { lanes[j].at += 64 * steps; lanes[j].left -= steps; }
    }
}

#else /* not x86-64 with GCC or clang: never used */
int x16_available(void) { return 0; }
void x16_init(X16State *state) { (void)state; }
void x16_blocks(X16State *state, const unsigned char *const p[X16_LANES], size_t off, size_t nblocks) {
    (void)state; (void)p; (void)off; (void)nblocks;
}
void x16_final(X16State *state, const unsigned char *const p[X16_LANES], size_t len,
               unsigned char *const out[X16_LANES]) {
    (void)state; (void)p; (void)len; (void)out;
}
void x16_many(const unsigned char *const *p, const size_t *len, const size_t *order, size_t n,
              unsigned char *const *out, void (*started)(void *, size_t), void *arg) {
    (void)p; (void)len; (void)order; (void)n; (void)out; (void)started; (void)arg;
}
#endif
