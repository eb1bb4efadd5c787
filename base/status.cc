#include "base/status.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace tierkv {

absl::Status ErrnoToStatus(int err, absl::string_view what) {
  std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(msg);
    case EEXIST:
      return absl::AlreadyExistsError(msg);
    case EINVAL:
    case ERANGE:
      return absl::InvalidArgumentError(msg);
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE:
      return absl::ResourceExhaustedError(msg);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(msg);
    case ETIMEDOUT:
      return absl::DeadlineExceededError(msg);
    case EAGAIN:
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case EINTR:
      return absl::UnavailableError(msg);
    default:
      return absl::InternalError(msg);
  }
}

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

}  // namespace tierkv
