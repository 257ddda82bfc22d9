/* SHA-256 of 16 equal-length buffers at once (AVX-512); see _sha256_x16.c. */
#ifndef CAS_CKPT_SHA256_X16_H
#define CAS_CKPT_SHA256_X16_H
#include <stddef.h>
#include <stdint.h>

#define X16_LANES 16

typedef struct { uint32_t h[8][X16_LANES]; } X16State;

int x16_available(void); /* this CPU and OS run AVX-512 (F and BW) */
void x16_init(X16State *state);
/* `nblocks` blocks of 64 bytes of each lane, from p[j] + off */
void x16_blocks(X16State *state, const unsigned char *const p[X16_LANES], size_t off, size_t nblocks);
/* the rest of each lane's `len` bytes from p[j] + len / 64 * 64, padded; digests to out[j] (or none if NULL) */
void x16_final(X16State *state, const unsigned char *const p[X16_LANES], size_t len,
               unsigned char *const out[X16_LANES]);
/* The digests of n buffers of any lengths, buffer order[0] first: a lane that finishes one
 * takes the next, so lanes stay busy until the last few. Buffer b is p[b], len[b] bytes, its
 * digest to out[b]; started(arg, b), if not NULL, is called just before b's first block is
 * read (a caller may fill it then, so that it is hashed while in cache). */
void x16_many(const unsigned char *const *p, const size_t *len, const size_t *order, size_t n,
              unsigned char *const *out, void (*started)(void *, size_t), void *arg);
#endif
