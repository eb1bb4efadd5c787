#include "base/crc32c.h"

#include <cstring>
#include <string_view>

#include <algorithm>

#if defined(__x86_64__)
#include <immintrin.h>
#include <nmmintrin.h>
#endif

namespace tierkv {
namespace {

struct Table {
  uint32_t t[256];
  Table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1)));
      t[i] = c;
    }
  }
};

uint32_t Software(uint32_t crc, const uint8_t* p, size_t n) {
  static const Table table;
  for (size_t i = 0; i < n; ++i) crc = table.t[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return crc;
}

// Arithmetic on CRC values as polynomials over GF(2) modulo the
// (bit-reflected) Castagnoli polynomial, to join CRCs computed separately:
// crc(A || B) = crc(A) * x^(8|B|) + crc(B).
constexpr uint32_t kPoly = 0x82f63b78u;

// a * b mod P, in the reflected representation (x^0 is the top bit).
uint32_t MulModP(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t bit = 1u << 31; bit != 0; bit >>= 1) {
    if (a & bit) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return product;
}

// x^n mod P (x^(8 * bytes) shifts a CRC past `bytes` zero bytes).
uint32_t XPow(uint64_t n) {
  uint32_t result = 1u << 31;  // x^0
  uint32_t power = 1u << 30;   // x^1
  for (; n != 0; n >>= 1) {
    if (n & 1) result = MulModP(result, power);
    power = MulModP(power, power);
  }
  return result;
}

#if defined(__x86_64__)
// The crc32 instruction has a latency of three cycles and a throughput of
// one: three independent lanes keep it busy, and the lanes' CRCs are then
// joined with one multiplication each.
constexpr size_t kLane = 8192;

__attribute__((target("sse4.2"))) uint32_t Hardware(uint32_t crc, const uint8_t* p, size_t n) {
  static const uint32_t shift = XPow(8 * kLane);
  while (n >= 3 * kLane) {
    uint64_t a = crc, b = 0xffffffffu, c = 0xffffffffu;
    const uint8_t* pa = p;
    const uint8_t* pb = p + kLane;
    const uint8_t* pc = p + 2 * kLane;
    for (size_t i = 0; i < kLane; i += 8) {
      uint64_t va, vb, vc;
      std::memcpy(&va, pa + i, 8);
      std::memcpy(&vb, pb + i, 8);
      std::memcpy(&vc, pc + i, 8);
      a = _mm_crc32_u64(a, va);
      b = _mm_crc32_u64(b, vb);
      c = _mm_crc32_u64(c, vc);
    }
    // Join in the finalised (inverted) domain, then return to the raw one.
    uint32_t fa = ~static_cast<uint32_t>(a), fb = ~static_cast<uint32_t>(b), fc = ~static_cast<uint32_t>(c);
    uint32_t ab = MulModP(shift, fa) ^ fb;
    crc = ~(MulModP(shift, ab) ^ fc);
    p += 3 * kLane;
    n -= 3 * kLane;
  }
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n > 0) {
    c32 = _mm_crc32_u8(c32, *p++);
    --n;
  }
  return c32;
}

// Folding with carry-less multiplication (VPCLMULQDQ on 512-bit
// registers), several times the crc32 instruction's rate. The data is a
// polynomial M over GF(2) and the CRC is M * x^32 mod P, so any 128-bit
// block A that lies D bits before a block B can be replaced by a residue of
// A * x^D, XORed into B, without changing the CRC. Memory holds the
// polynomial bit-reflected (the first bit is the highest power), so each
// 64-bit half of A is multiplied by x^(D+63) or x^(D-1) mod P (the -1
// makes up for the product of two reflected operands landing one bit
// low). What is left after folding is one 16-byte block whose CRC, taken
// with the crc32 instruction, is the CRC of everything folded into it; no
// Barrett reduction is needed.
struct FoldConstant {
  uint64_t low_half;   // for the block's first 8 bytes (its high powers)
  uint64_t high_half;  // for its last 8 bytes
};
// A residue as a 64-bit reflected operand: its 32 bits in the upper half.
FoldConstant FoldBy(uint64_t bytes) {
  return {static_cast<uint64_t>(XPow(8 * bytes + 63)) << 32, static_cast<uint64_t>(XPow(8 * bytes - 1)) << 32};
}

#define TIERKV_FOLD_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,vpclmulqdq,pclmul,sse4.2")))

TIERKV_FOLD_TARGET inline __m512i Broadcast(FoldConstant k) {
  return _mm512_set_epi64(k.high_half, k.low_half, k.high_half, k.low_half, k.high_half, k.low_half, k.high_half,
                          k.low_half);
}
// Each 128-bit lane of `a` folded onto the same lane of `b`.
TIERKV_FOLD_TARGET inline __m512i Fold(__m512i a, __m512i b, __m512i k) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a, k, 0x00), _mm512_clmulepi64_epi128(a, k, 0x11), b,
                                   0x96);
}
TIERKV_FOLD_TARGET inline __m128i Fold(__m128i a, __m128i b, __m128i k) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(a, k, 0x00), _mm_clmulepi64_si128(a, k, 0x11)), b);
}

// Below this the fold's set-up costs more than it saves.
constexpr size_t kFoldMin = 512;

// Four registers to dst: cached stores, or with kStream (dst 64-byte
// aligned) non-temporal ones, which write whole lines around the cache.
template <bool kStream>
TIERKV_FOLD_TARGET inline void Store256(char* dst, __m512i v0, __m512i v1, __m512i v2, __m512i v3) {
  if constexpr (kStream) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v0);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + 64), v1);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + 128), v2);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + 192), v3);
  } else {
    _mm512_storeu_si512(dst, v0);
    _mm512_storeu_si512(dst + 64, v1);
    _mm512_storeu_si512(dst + 128, v2);
    _mm512_storeu_si512(dst + 192, v3);
  }
}

// The raw (uninverted) CRC of p[0, n) from `crc`, n >= kFoldMin; with
// kCopy, also copies the bytes to dst as it reads them, so a copy and its
// checksum cost one pass over the data (kStream: see Store256).
template <bool kCopy, bool kStream = false>
TIERKV_FOLD_TARGET uint32_t Folded(uint32_t crc, char* dst, const uint8_t* p, size_t n) {
  static const FoldConstant by256 = FoldBy(256), by64 = FoldBy(64), by16 = FoldBy(16);
  const __m512i k256 = Broadcast(by256), k64 = Broadcast(by64);
  __m512i a0 = _mm512_loadu_si512(p), a1 = _mm512_loadu_si512(p + 64);
  __m512i a2 = _mm512_loadu_si512(p + 128), a3 = _mm512_loadu_si512(p + 192);
  if constexpr (kCopy) Store256<kStream>(dst, a0, a1, a2, a3);
  // The running CRC is XORed into the first four bytes, as crc32 does.
  a0 = _mm512_xor_si512(a0, _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(crc))));
  size_t at = 256;
  for (; at + 256 <= n; at += 256) {
    __m512i b0 = _mm512_loadu_si512(p + at), b1 = _mm512_loadu_si512(p + at + 64);
    __m512i b2 = _mm512_loadu_si512(p + at + 128), b3 = _mm512_loadu_si512(p + at + 192);
    if constexpr (kCopy) Store256<kStream>(dst + at, b0, b1, b2, b3);
    a0 = Fold(a0, b0, k256);
    a1 = Fold(a1, b1, k256);
    a2 = Fold(a2, b2, k256);
    a3 = Fold(a3, b3, k256);
  }
  a1 = Fold(a0, a1, k64);
  a2 = Fold(a1, a2, k64);
  a3 = Fold(a2, a3, k64);
  const __m128i k16 = _mm_set_epi64x(static_cast<int64_t>(by16.high_half), static_cast<int64_t>(by16.low_half));
  // Its four lanes, 16 bytes apart (through memory: GCC 12 warns about
  // the extract intrinsic's undefined operand).
  alignas(64) uint8_t lanes[64];
  _mm512_store_si512(lanes, a3);
  __m128i last = _mm_load_si128(reinterpret_cast<const __m128i*>(lanes));
  for (int lane = 1; lane < 4; ++lane) {
    last = Fold(last, _mm_load_si128(reinterpret_cast<const __m128i*>(lanes + 16 * lane)), k16);
  }
  uint64_t c = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(last)));
  c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(last, 1)));
  if constexpr (kCopy) {
    // Streamed lines reach memory before any later store does.
    if constexpr (kStream) _mm_sfence();
    // The tail is checksummed where it landed: a source that changes
    // under the copy (shared memory) still gets the CRC of what was copied.
    std::memcpy(dst + at, p + at, n - at);
    return Hardware(static_cast<uint32_t>(c), reinterpret_cast<const uint8_t*>(dst) + at, n - at);
  }
  return Hardware(static_cast<uint32_t>(c), p + at, n - at);
}
#endif

bool FoldAvailable() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("vpclmulqdq") &&
                          __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.2");
  return has;
#else
  return false;
#endif
}

}  // namespace

bool Crc32cHardware() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
#else
  return false;
#endif
}

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  if (size >= kFoldMin && FoldAvailable()) return ~Folded<false>(crc, nullptr, p, size);
  if (Crc32cHardware()) return ~Hardware(crc, p, size);
#endif
  return ~Software(crc, p, size);
}

namespace {

// Without the fold: copy a block and checksum it while it is still in
// cache, rather than reading the whole value from memory twice. A block is
// a multiple of the crc32 path's three 8 KiB lanes.
uint32_t CopyBlocks(uint32_t crc, void* dst, const void* src, size_t size) {
  constexpr size_t kBlock = 96 << 10;
  char* out = static_cast<char*>(dst);
  const char* in = static_cast<const char*>(src);
  for (size_t at = 0; at < size; at += kBlock) {
    const size_t len = std::min(kBlock, size - at);
    std::memcpy(out + at, in + at, len);
    crc = Crc32cExtend(crc, out + at, len);
  }
  return crc;
}

}  // namespace

#if defined(__x86_64__)
// The fold's copy, from the raw CRC `crc`, n >= kFoldMin. It stores whole
// registers: into a destination off a 64-byte line (a malloc'd buffer
// usually is, by 16) every store would split two lines, so the bytes up to
// dst's next line go first.
uint32_t FoldedCopy(uint32_t crc, char* dst, const uint8_t* src, size_t n) {
  const size_t head = (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64;
  if (head > 0 && n - head >= kFoldMin) {
    std::memcpy(dst, src, head);
    crc = Hardware(crc, reinterpret_cast<const uint8_t*>(dst), head);  // what landed, as the fold's tail
    dst += head;
    src += head;
    n -= head;
  }
  return Folded<true>(crc, dst, src, n);
}
#endif

uint32_t Crc32cCopy(uint32_t crc, void* dst, const void* src, size_t size) {
#if defined(__x86_64__)
  if (size >= kFoldMin && FoldAvailable()) {
    return ~FoldedCopy(~crc, static_cast<char*>(dst), static_cast<const uint8_t*>(src), size);
  }
#endif
  return CopyBlocks(crc, dst, src, size);
}

#if defined(__x86_64__)
namespace {

// The streaming copy without a checksum: cached stores up to dst's next
// line, whole lines streamed, the tail cached again.
TIERKV_FOLD_TARGET void StreamLines(char* dst, const char* src, size_t size) {
  const size_t head = std::min(size, (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64);
  std::memcpy(dst, src, head);
  size_t at = head;
  for (; at + 256 <= size; at += 256) {
    Store256<true>(dst + at, _mm512_loadu_si512(src + at), _mm512_loadu_si512(src + at + 64),
                   _mm512_loadu_si512(src + at + 128), _mm512_loadu_si512(src + at + 192));
  }
  _mm_sfence();
  std::memcpy(dst + at, src + at, size - at);
}

bool StreamAvailable() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

}  // namespace
#endif

void CopyOut(void* dst, const void* src, size_t size) {
#if defined(__x86_64__)
  if (size >= kCopyOutMin && StreamAvailable()) {
    StreamLines(static_cast<char*>(dst), static_cast<const char*>(src), size);
    return;
  }
#endif
  std::memcpy(dst, src, size);
}

uint32_t Crc32cCopyOut(uint32_t crc, void* dst, const void* src, size_t size) {
#if defined(__x86_64__)
  if (size >= kCopyOutMin && reinterpret_cast<uintptr_t>(dst) % 64 == 0 && FoldAvailable()) {
    return ~Folded<true, true>(~crc, static_cast<char*>(dst), static_cast<const uint8_t*>(src), size);
  }
#endif
  return Crc32cCopy(crc, dst, src, size);
}

bool Crc32cExtendVia(const char* path, uint32_t* crc, void* dst, const void* data, size_t size) {
  const std::string_view want(path);
  const uint8_t* p = static_cast<const uint8_t*>(data);
  if (want == "table") {
    *crc = ~Software(~*crc, p, size);
    return true;
  }
  if (want == "copy-blocks") {
    *crc = CopyBlocks(*crc, dst, data, size);
    return true;
  }
#if defined(__x86_64__)
  if (want == "sse4.2" && Crc32cHardware()) {
    *crc = ~Hardware(~*crc, p, size);
    return true;
  }
  if ((want == "vpclmulqdq" || want == "vpclmulqdq-copy") && FoldAvailable()) {
    if (size < kFoldMin) return false;
    const bool copy = want == "vpclmulqdq-copy";
    *crc = copy ? ~FoldedCopy(~*crc, static_cast<char*>(dst), p, size) : ~Folded<false>(~*crc, nullptr, p, size);
    return true;
  }
  if (want == "vpclmulqdq-stream" && FoldAvailable()) {
    if (size < kFoldMin || reinterpret_cast<uintptr_t>(dst) % 64 != 0) return false;
    *crc = ~Folded<true, true>(~*crc, static_cast<char*>(dst), p, size);
    return true;
  }
#endif
  return false;
}

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t b_size) {
  return b_size == 0 ? crc_a : MulModP(crc_a, XPow(8 * b_size)) ^ crc_b;
}

const char* Crc32cPath() {
  if (FoldAvailable()) return "vpclmulqdq";
  return Crc32cHardware() ? "sse4.2" : "table";
}

}  // namespace tierkv
