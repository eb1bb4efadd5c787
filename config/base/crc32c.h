// CRC32C (Castagnoli), the checksum tierkv stores with every value.
// Uses the SSE4.2 crc32 instruction when the CPU has it (checked once at
// run time), a table otherwise; both give identical results.
//
//   uint32_t c = Crc32c(data, size);
//   c = Crc32cExtend(c, more, more_size);  // same as one call over both
#pragma once

#include <cstddef>
#include <cstdint>

namespace tierkv {

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size);
inline uint32_t Crc32c(const void* data, size_t size) { return Crc32cExtend(0, data, size); }
// True when the hardware path is in use.
bool Crc32cHardware();

}  // namespace tierkv
