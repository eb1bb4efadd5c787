// CRC32C (Castagnoli), the checksum tierkv stores with every value.
// Folds with carry-less multiplication (AVX-512 VPCLMULQDQ) where the CPU
// has it, else uses the SSE4.2 crc32 instruction, else a table (checked
// once at run time); all give identical results.
//
//   uint32_t c = Crc32c(data, size);
//   c = Crc32cExtend(c, more, more_size);  // same as one call over both
//   c = Crc32cCopy(0, dst, src, n);         // memcpy(dst, src, n) and Crc32c(src, n)
#pragma once

#include <cstddef>
#include <cstdint>

namespace tierkv {

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size);
inline uint32_t Crc32c(const void* data, size_t size) { return Crc32cExtend(0, data, size); }
// The CRC of A || B from crc_a = Crc32cExtend(c, A, |A|) and crc_b = Crc32c(B, b_size): for
// checksums of pieces written apart (in any order) and joined later.
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t b_size);
// Copies `size` bytes from src to dst (which must not overlap) and returns
// Crc32cExtend(crc, dst, size): the CRC of the bytes as they landed, even if
// the source changes during the copy, reading the source once.
uint32_t Crc32cCopy(uint32_t crc, void* dst, const void* src, size_t size);
// A copy into memory this thread will not read again soon (a value put
// into a store's segment): from kCopyOutMin bytes on, whole cache lines are
// written with non-temporal stores, which skip the read of each line that a
// cached store makes first (about 1.5x memcpy's bandwidth to memory not in
// cache) and leave the cache to what the caller uses next; an sfence
// orders them before the caller's later stores. Smaller copies are
// memcpy. Crc32cCopyOut is Crc32cCopy's counterpart, streaming where dst is
// 64-byte aligned.
inline constexpr size_t kCopyOutMin = 256 << 10;
void CopyOut(void* dst, const void* src, size_t size);
uint32_t Crc32cCopyOut(uint32_t crc, void* dst, const void* src, size_t size);
// True when the crc32 instruction is in use.
bool Crc32cHardware();
// The path long buffers take: "vpclmulqdq", "sse4.2" or "table".
const char* Crc32cPath();

// For tests: *crc = Crc32cExtend(*crc, data, size) through one path:
// "table", "sse4.2", "vpclmulqdq" (size >= 512), or Crc32cCopy's two,
// "vpclmulqdq-copy" (size >= 512) and "copy-blocks", or Crc32cCopyOut's
// "vpclmulqdq-stream" (size >= 512, dst 64-byte aligned), which also copy
// to dst. False when this CPU, size or dst cannot take that path.
bool Crc32cExtendVia(const char* path, uint32_t* crc, void* dst, const void* data, size_t size);

}  // namespace tierkv
