#include "transport/tcp/wire.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace tierkv::transport::tcp {
namespace {

void Put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void Put64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t Get32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}
uint64_t Get64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

}  // namespace

void EncodeRequest(const RequestHeader& h, uint8_t out[kRequestSize]) {
  std::memset(out, 0, kRequestSize);
  Put32(out, kRequestMagic);
  out[4] = static_cast<uint8_t>(h.op);
  out[5] = h.flags;
  Put32(out + 8, h.segment);
  Put32(out + 12, h.deadline_ms32);
  Put64(out + 16, h.segment_id);
  Put64(out + 24, h.id);
  Put64(out + 32, h.offset);
  Put64(out + 40, h.length);
  Put64(out + 48, h.epoch);
}

void EncodeRange(const WireRange& r, uint8_t out[kRangeBytes]) {
  Put64(out, r.offset);
  Put64(out + 8, r.length);
}

WireRange DecodeRange(const uint8_t in[kRangeBytes]) { return {Get64(in), Get64(in + 8)}; }

absl::Status CheckVectorHeader(const RequestHeader& h, uint64_t max_data) {
  const bool write = h.op == WireOp::kWriteV;
  const char* what = write ? "writev" : "readv";
  // A table of at most kMaxRanges plain entries' bytes (1 MiB), whatever
  // its entries carry.
  const uint64_t max_ranges = kMaxRanges * kRangeBytes / RangeEntryBytes(h);
  if (h.offset == 0 || h.offset > max_ranges) {
    return absl::Status(h.offset == 0 ? absl::StatusCode::kInvalidArgument : absl::StatusCode::kResourceExhausted,
                        absl::StrCat(what, " of ", h.offset, " ranges: a frame carries 1 to ", max_ranges));
  }
  const uint64_t table = h.offset * RangeEntryBytes(h);
  if (write ? h.length < table : h.length != table) {
    return absl::InvalidArgumentError(absl::StrCat(what, " of ", h.offset, " ranges carries ", h.length,
                                                   " payload bytes, which do not fit its table"));
  }
  if (write && h.length - table > max_data) {
    return absl::ResourceExhaustedError(
        absl::StrCat("writev of ", h.length - table, " bytes exceeds the frame cap ", max_data));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> DecodeRanges(const RequestHeader& h, const std::string& table, uint64_t max_data,
                                      std::vector<WireRange>* ranges, std::vector<absl::string_view>* grants) {
  const bool write = h.op == WireOp::kWriteV;
  const size_t entry = RangeEntryBytes(h);
  ranges->resize(h.offset);
  if (grants != nullptr) grants->clear();
  uint64_t total = 0;
  bool overflow = false;
  for (size_t i = 0; i < ranges->size(); ++i) {
    (*ranges)[i] = DecodeRange(reinterpret_cast<const uint8_t*>(table.data()) + i * entry);
    if (grants != nullptr && entry > kRangeBytes) {
      grants->push_back(absl::string_view(table).substr(i * entry + kRangeBytes, kGrantBlockBytes));
    }
    overflow |= (*ranges)[i].length > UINT64_MAX - total;
    if (!overflow) total += (*ranges)[i].length;
  }
  const std::string sum = overflow ? std::string("over 2^64") : absl::StrCat(total);
  const uint64_t carried = h.length - h.offset * entry;
  if (write && (overflow || total != carried)) {
    return absl::InvalidArgumentError(absl::StrCat("writev ranges total ", sum, " bytes; it carries ", carried));
  }
  if (!write && (overflow || total > max_data)) {
    return absl::ResourceExhaustedError(absl::StrCat("readv of ", sum, " bytes exceeds the frame cap ", max_data));
  }
  return total;
}

void EncodeReply(const ReplyHeader& h, uint8_t out[kReplySize]) {
  std::memset(out, 0, kReplySize);
  Put32(out, kReplyMagic);
  out[4] = static_cast<uint8_t>(h.status);
  Put64(out + 8, h.id);
  Put64(out + 16, h.length);
}

size_t EncodeHead(RequestHeader h, absl::string_view grant, uint8_t out[kHeadMax]) {
  if (grant.size() != kGrantBlockBytes) {
    h.flags &= static_cast<uint8_t>(~kHasGrant);
    EncodeRequest(h, out);
    return kRequestSize;
  }
  h.flags |= kHasGrant;
  EncodeRequest(h, out);
  std::memcpy(out + kRequestSize, grant.data(), kGrantBlockBytes);
  return kHeadMax;
}

absl::StatusOr<RequestHeader> DecodeRequest(const uint8_t* data, size_t size) {
  if (size < kRequestSize) return absl::InvalidArgumentError("short request header");
  if (Get32(data) != kRequestMagic) return absl::InvalidArgumentError("bad request magic");
  RequestHeader h;
  uint8_t op = data[4];
  if (op < 1 || op > kMaxWireOp) return absl::InvalidArgumentError(absl::StrCat("unknown op ", op));
  h.op = static_cast<WireOp>(op);
  h.flags = data[5];
  h.segment = Get32(data + 8);
  h.deadline_ms32 = Get32(data + 12);
  h.segment_id = Get64(data + 16);
  h.id = Get64(data + 24);
  h.offset = Get64(data + 32);
  h.length = Get64(data + 40);
  h.epoch = Get64(data + 48);
  return h;
}

absl::StatusOr<ReplyHeader> DecodeReply(const uint8_t* data, size_t size) {
  if (size < kReplySize) return absl::InvalidArgumentError("short reply header");
  if (Get32(data) != kReplyMagic) return absl::InvalidArgumentError("bad reply magic");
  ReplyHeader h;
  uint8_t st = data[4];
  if (st > kMaxWireStatus) return absl::InvalidArgumentError(absl::StrCat("unknown reply status ", st));
  h.status = static_cast<WireStatus>(st);
  h.id = Get64(data + 8);
  h.length = Get64(data + 16);
  return h;
}

uint32_t DeadlineMs32(absl::Time t) { return static_cast<uint32_t>(absl::ToUnixMillis(t)); }

bool DeadlinePassed(uint32_t deadline_ms32, absl::Time now) {
  return static_cast<int32_t>(deadline_ms32 - DeadlineMs32(now)) < 0;
}

absl::Status ReplyToStatus(WireStatus status, const std::string& message) {
  switch (status) {
    case WireStatus::kOk:
      return absl::OkStatus();
    case WireStatus::kOutOfRange:
      return absl::OutOfRangeError(message);
    case WireStatus::kNoSegment:
      return absl::NotFoundError(message);
    case WireStatus::kTooLarge:
      return absl::ResourceExhaustedError(message);
    case WireStatus::kBadRequest:
      return absl::InvalidArgumentError(message);
    case WireStatus::kInternal:
      return absl::InternalError(message);
    case WireStatus::kExpired:
      return absl::DeadlineExceededError(message);
    case WireStatus::kBusy:
      return absl::UnavailableError(message);
    case WireStatus::kUnauthenticated:
      return absl::UnauthenticatedError(message);
    case WireStatus::kStaleEpoch:
      return absl::FailedPreconditionError(message);
    case WireStatus::kDenied:
      return absl::PermissionDeniedError(message);
  }
  return absl::InternalError(message);
}

}  // namespace tierkv::transport::tcp
