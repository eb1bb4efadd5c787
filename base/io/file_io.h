// FileIo: the seam between the SSD tier (store/ssd_tier.h) and the disk.
// A FileIo is one fixed-size file; Run executes a batch of positioned reads
// and writes as one submission and waits for all of them. The real one
// (OpenUringFile) uses io_uring on a file opened with O_DIRECT; the fake
// (FakeFileIo) keeps the bytes in memory and injects errors and tears, so
// the tier's record format, scan and fault handling are tested without a
// disk.
//
//   ASSIGN_OR_RETURN(auto file, OpenUringFile({.path = "/ssd/tierkv-ssd.dat", .size = 1 << 30}));
//   IoOp ops[2] = {{IoOp::kWrite, 0, buf, 4096}, {IoOp::kRead, 8192, buf2, 4096}};
//   RETURN_IF_ERROR(file->Run(absl::MakeSpan(ops)));  // then ops[i].result
//
// With O_DIRECT, offsets, lengths and buffer addresses must be multiples of
// kIoAlign (AlignedBuffer gives such memory). Thread-safe: the real one has
// FileIoOptions::rings rings, so that many concurrent Run calls are in
// flight at once (more wait for a ring); the fake serialises them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/mutex.h"

namespace tierkv::io {

inline constexpr size_t kIoAlign = 4096;

inline uint64_t AlignUp(uint64_t n, uint64_t a = kIoAlign) { return (n + a - 1) / a * a; }

// Memory aligned to kIoAlign (its size rounded up to it), for O_DIRECT
// transfers; zero-filled unless `zero` is false.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t size, bool zero = true);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& o) noexcept : data_(o.data_), size_(o.size_) { o.data_ = nullptr, o.size_ = 0; }
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  char* data_ = nullptr;
  size_t size_ = 0;
};

struct IoOp {
  enum Kind : uint8_t { kRead, kWrite };
  Kind kind = kRead;
  uint64_t offset = 0;
  void* buf = nullptr;
  size_t len = 0;
  int64_t result = 0;  // set by Run: bytes moved, or -errno
};

class FileIo {
 public:
  virtual ~FileIo() = default;
  // Runs every op and waits for all; each op's `result` is set. Up to
  // queue_depth ops go in one submission (a larger batch takes several).
  // Non-OK only when the batch could not be submitted at all (then no
  // result is meaningful).
  virtual absl::Status Run(absl::Span<IoOp> ops) = 0;
  virtual uint64_t size() const = 0;
  // True when transfers bypass the page cache (O_DIRECT).
  virtual bool direct() const = 0;
  // Submissions made so far (a batch of n <= queue_depth ops is one).
  virtual uint64_t submissions() const = 0;
};

struct FileIoOptions {
  std::string path;
  uint64_t size = 0;          // the file is created or resized to this
  bool direct = true;         // O_DIRECT; falls back to buffered on EINVAL (tmpfs), logging why
  unsigned queue_depth = 256;  // per ring; a larger batch takes several submissions
  unsigned rings = 4;
};

// Opens (creating if absent) and preallocates the file. RESOURCE_EXHAUSTED
// when the file system cannot hold `size` bytes; FAILED_PRECONDITION when
// io_uring is unavailable (seccomp, old kernel); INTERNAL for other errors.
absl::StatusOr<std::unique_ptr<FileIo>> OpenUringFile(const FileIoOptions& options);

// OK when this process may set up an io_uring; otherwise FAILED_PRECONDITION
// naming why (a seccomp profile that blocks it, a kernel without it), so a
// caller can say so before trying a file.
absl::Status UringAvailable();

// In-memory FileIo for tests. Instances made from one Storage see the same
// bytes, as a daemon restarted on the same file would.
class FakeFileIo : public FileIo {
 public:
  struct Storage {
    Mutex mu;
    std::string bytes ABSL_GUARDED_BY(mu);
  };
  static std::shared_ptr<Storage> NewStorage(uint64_t size);

  explicit FakeFileIo(std::shared_ptr<Storage> storage, unsigned queue_depth = 256);

  absl::Status Run(absl::Span<IoOp> ops) override;
  uint64_t size() const override { return size_; }
  bool direct() const override { return true; }
  uint64_t submissions() const override;

  // Every later op of `kind` fails with -err (0 clears it).
  void FailOps(IoOp::Kind kind, int err);
  // The next write stores only its first `bytes` bytes yet reports success,
  // as a crash in the middle of a write would leave it.
  void TearNextWrite(size_t bytes);
  // Every later batch takes at least this long (a slow disk).
  void Delay(absl::Duration d);
  // Ops run so far, by kind.
  uint64_t reads() const;
  uint64_t writes() const;

 private:
  const std::shared_ptr<Storage> storage_;
  const uint64_t size_;
  const unsigned queue_depth_;
  mutable Mutex mu_;
  int read_error_ ABSL_GUARDED_BY(mu_) = 0;
  int write_error_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t tear_next_ ABSL_GUARDED_BY(mu_) = -1;
  absl::Duration delay_ ABSL_GUARDED_BY(mu_);
  uint64_t submissions_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reads_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t writes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tierkv::io
