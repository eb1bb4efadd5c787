#include "proto/direct_frame.h"

#include <bit>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace tierkv::direct {
namespace {

static_assert(std::endian::native == std::endian::little, "direct frames are little-endian");

void Put32(char* p, uint32_t v) { std::memcpy(p, &v, 4); }
uint32_t Get32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

}  // namespace

const char* MethodName(DirectMethod m) {
  switch (m) {
    case DirectMethod::kPutStart:
      return "PutStart";
    case DirectMethod::kPutEnd:
      return "PutEnd";
    case DirectMethod::kPutRevoke:
      return "PutRevoke";
    case DirectMethod::kGetReplicas:
      return "GetReplicas";
    case DirectMethod::kExists:
      return "Exists";
    case DirectMethod::kPrefixMatch:
      return "PrefixMatch";
    case DirectMethod::kRemove:
      return "Remove";
    case DirectMethod::kStats:
      return "Stats";
    case DirectMethod::kPing:
      return "Ping";
    case DirectMethod::kReplicate:
      return "Replicate";
  }
  return "unknown";
}

void EncodeCall(const CallHeader& h, char out[kHeaderSize]) {
  std::memset(out, 0, kHeaderSize);
  Put32(out, kCallMagic);
  out[4] = static_cast<char>(h.method);
  Put32(out + 12, h.length);
}

void EncodeReply(const ReplyHeader& h, char out[kHeaderSize]) {
  std::memset(out, 0, kHeaderSize);
  Put32(out, kReplyMagic);
  out[4] = static_cast<char>(h.code);
  Put32(out + 8, h.message_length);
  Put32(out + 12, h.length);
}

absl::StatusOr<CallHeader> DecodeCall(const char in[kHeaderSize], uint32_t max_length) {
  if (Get32(in) != kCallMagic) return absl::InvalidArgumentError("not a direct call frame (bad magic)");
  const uint8_t method = static_cast<uint8_t>(in[4]);
  if (method < 1 || method > kMaxMethod) {
    return absl::InvalidArgumentError(absl::StrCat("unknown direct method ", method));
  }
  CallHeader h;
  h.method = static_cast<DirectMethod>(method);
  h.length = Get32(in + 12);
  if (h.length > max_length) {
    return absl::ResourceExhaustedError(absl::StrCat(MethodName(h.method), ": a request of ", h.length,
                                                     " bytes exceeds the master's limit of ", max_length));
  }
  return h;
}

absl::StatusOr<ReplyHeader> DecodeReply(const char in[kHeaderSize], uint32_t max_length) {
  if (Get32(in) != kReplyMagic) return absl::InvalidArgumentError("not a direct reply frame (bad magic)");
  ReplyHeader h;
  h.code = static_cast<uint8_t>(in[4]);
  h.message_length = Get32(in + 8);
  h.length = Get32(in + 12);
  if (h.code > 16) return absl::InvalidArgumentError(absl::StrCat("direct reply with unknown code ", h.code));
  if (h.code != 0 && h.length != 0) return absl::InvalidArgumentError("direct error reply with a response");
  if (h.message_length > kMaxMessage || h.length > max_length) {
    return absl::ResourceExhaustedError(absl::StrCat("direct reply of ", h.length, " bytes (message ",
                                                     h.message_length, ") exceeds the limit of ", max_length));
  }
  return h;
}

}  // namespace tierkv::direct
