#include "config/base/crc32c.h"

#include <cstring>

#if defined(__x86_64__)
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

// x^(8 * bytes) mod P.
uint32_t ShiftFor(uint64_t bytes) {
  uint32_t result = 1u << 31;  // x^0
  uint32_t power = 1u << 23;   // x^8: one byte
  for (uint64_t n = bytes; n != 0; n >>= 1) {
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
  static const uint32_t shift = ShiftFor(kLane);
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
#endif

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
  if (Crc32cHardware()) return ~Hardware(crc, p, size);
#endif
  return ~Software(crc, p, size);
}

}  // namespace tierkv
