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

void EncodeReply(const ReplyHeader& h, uint8_t out[kReplySize]) {
  std::memset(out, 0, kReplySize);
  Put32(out, kReplyMagic);
  out[4] = static_cast<uint8_t>(h.status);
  Put64(out + 8, h.id);
  Put64(out + 16, h.length);
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
  }
  return absl::InternalError(message);
}

}  // namespace tierkv::transport::tcp
