#include "base/io/file_io.h"

#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <vector>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/failpoint.h"
#include "base/log.h"
#include "base/status.h"

namespace tierkv::io {

AlignedBuffer::AlignedBuffer(size_t size, bool zero) : size_(size) {
  if (size == 0) return;
  void* p = nullptr;
  if (posix_memalign(&p, kIoAlign, AlignUp(size)) != 0) {
    size_ = 0;
    return;
  }
  if (zero) std::memset(p, 0, AlignUp(size));
  data_ = static_cast<char*>(p);
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  if (this != &o) {
    std::free(data_);
    data_ = o.data_;
    size_ = o.size_;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

namespace {

// Several rings, each behind its own lock, so batches from concurrent
// callers (the daemon's request threads) are in flight together instead of
// queueing behind one another's completions.
class UringFileIo : public FileIo {
 public:
  UringFileIo(int fd, uint64_t size, bool direct, unsigned depth, unsigned rings)
      : fd_(fd), size_(size), direct_(direct), depth_(depth), rings_(rings) {}
  ~UringFileIo() override {
    for (Ring& r : rings_) {
      MutexLock lock(&r.mu);
      if (r.ready) io_uring_queue_exit(&r.ring);
    }
    close(fd_);
  }

  absl::Status Init() {
    for (Ring& r : rings_) {
      MutexLock lock(&r.mu);
      int rc = io_uring_queue_init(depth_, &r.ring, 0);
      if (rc < 0) return ErrnoToStatus(-rc, "io_uring_queue_init");
      r.ready = true;
    }
    return absl::OkStatus();
  }

  absl::Status Run(absl::Span<IoOp> ops) override {
    if (ops.empty()) return absl::OkStatus();
    size_t first = next_.fetch_add(1, std::memory_order_relaxed) % rings_.size();
    for (size_t k = 0; k < rings_.size(); ++k) {
      Ring& r = rings_[(first + k) % rings_.size()];
      if (r.mu.TryLock()) {
        absl::Status s = RunOn(r, ops);
        r.mu.Unlock();
        return s;
      }
    }
    Ring& r = rings_[first];
    MutexLock lock(&r.mu);
    return RunOn(r, ops);
  }

  uint64_t size() const override { return size_; }
  bool direct() const override { return direct_; }
  uint64_t submissions() const override { return submissions_.load(std::memory_order_relaxed); }

 private:
  struct Ring {
    Mutex mu;
    io_uring ring ABSL_GUARDED_BY(mu){};
    bool ready ABSL_GUARDED_BY(mu) = false;
  };

  absl::Status RunOn(Ring& r, absl::Span<IoOp> ops) ABSL_EXCLUSIVE_LOCKS_REQUIRED(r.mu) {
    for (size_t begin = 0; begin < ops.size(); begin += depth_) {
      size_t n = std::min<size_t>(depth_, ops.size() - begin);
      for (size_t i = 0; i < n; ++i) {
        IoOp& op = ops[begin + i];
        io_uring_sqe* sqe = io_uring_get_sqe(&r.ring);
        if (sqe == nullptr) return absl::InternalError("io_uring: submission queue full");
        if (op.kind == IoOp::kRead) {
          io_uring_prep_read(sqe, fd_, op.buf, static_cast<unsigned>(op.len), op.offset);
        } else {
          io_uring_prep_write(sqe, fd_, op.buf, static_cast<unsigned>(op.len), op.offset);
        }
        io_uring_sqe_set_data64(sqe, begin + i);
      }
      int rc = io_uring_submit_and_wait(&r.ring, static_cast<unsigned>(n));
      if (rc < 0) return ErrnoToStatus(-rc, "io_uring_submit");
      submissions_.fetch_add(1, std::memory_order_relaxed);
      for (size_t done = 0; done < n;) {
        io_uring_cqe* cqe = nullptr;
        rc = io_uring_wait_cqe(&r.ring, &cqe);
        if (rc == -EINTR) continue;
        if (rc < 0) return ErrnoToStatus(-rc, "io_uring_wait_cqe");
        ops[io_uring_cqe_get_data64(cqe)].result = cqe->res;
        io_uring_cqe_seen(&r.ring, cqe);
        ++done;
      }
    }
    return absl::OkStatus();
  }

  const int fd_;
  const uint64_t size_;
  const bool direct_;
  const unsigned depth_;
  std::vector<Ring> rings_;
  std::atomic<size_t> next_{0};
  std::atomic<uint64_t> submissions_{0};
};

}  // namespace

absl::Status UringAvailable() {
  io_uring ring{};
  int rc = io_uring_queue_init(1, &ring, 0);
  if (rc < 0) return absl::FailedPreconditionError(absl::StrCat("io_uring is unavailable: ", strerror(-rc)));
  io_uring_queue_exit(&ring);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<FileIo>> OpenUringFile(const FileIoOptions& options) {
  if (options.size == 0 || options.size % kIoAlign != 0) {
    return absl::InvalidArgumentError(absl::StrCat("file size ", options.size, " is not a positive multiple of ", kIoAlign));
  }
  bool direct = options.direct;
  int fd = -1;
  if (direct) {
    fd = open(options.path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_DIRECT, 0644);
    int err = errno;
    // Some file systems take the flag at open and refuse the first
    // transfer instead: probe one aligned read.
    if (fd >= 0) {
      AlignedBuffer probe(kIoAlign);
      if (pread(fd, probe.data(), kIoAlign, 0) < 0 && errno == EINVAL) {
        err = EINVAL;
        close(fd);
        fd = -1;
      }
    }
    if (TIERKV_FAILPOINT("store.ssd.direct")) {  // as such a file system answers
      if (fd >= 0) close(fd);
      fd = -1;
      err = EINVAL;
    }
    if (fd < 0 && err == EINVAL) {
      // tmpfs before Linux 6.6 (and some FUSE file systems) refuse O_DIRECT;
      // the page cache then sits between us and the file, which costs
      // speed, not safety.
      TKV_LOG(WARNING) << options.path << ": O_DIRECT is not supported here (EINVAL); using buffered I/O";
      direct = false;
    } else if (fd < 0) {
      return ErrnoToStatus(err, absl::StrCat("open ", options.path));
    }
  }
  if (!direct) fd = open(options.path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("open ", options.path));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    int err = errno;
    close(fd);
    return ErrnoToStatus(err, absl::StrCat("stat ", options.path));
  }
  if (static_cast<uint64_t>(st.st_size) > options.size && ftruncate(fd, static_cast<off_t>(options.size)) != 0) {
    int err = errno;
    close(fd);
    return ErrnoToStatus(err, absl::StrCat("truncate ", options.path));
  }
  // Reserve the blocks now, so a full file system is found at start, not
  // by a write later.
  int rc = posix_fallocate(fd, 0, static_cast<off_t>(options.size));
  if (rc == EOPNOTSUPP || rc == EINVAL) rc = ftruncate(fd, static_cast<off_t>(options.size)) == 0 ? 0 : errno;
  if (rc != 0) {
    close(fd);
    if (rc == ENOSPC || rc == EFBIG || rc == EDQUOT) {
      return absl::ResourceExhaustedError(absl::StrCat(options.path, ": no room for ", options.size, " bytes"));
    }
    return ErrnoToStatus(rc, absl::StrCat("allocate ", options.path));
  }
  auto io = std::make_unique<UringFileIo>(fd, options.size, direct, std::max(1u, options.queue_depth),
                                         std::max(1u, options.rings));
  if (absl::Status s = io->Init(); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(options.path, ": ", s.message()));
  }
  return std::unique_ptr<FileIo>(std::move(io));
}

std::shared_ptr<FakeFileIo::Storage> FakeFileIo::NewStorage(uint64_t size) {
  auto s = std::make_shared<Storage>();
  MutexLock lock(&s->mu);
  s->bytes.assign(size, '\0');
  return s;
}

FakeFileIo::FakeFileIo(std::shared_ptr<Storage> storage, unsigned queue_depth)
    : storage_(std::move(storage)),
      size_([this] {
        MutexLock lock(&storage_->mu);
        return storage_->bytes.size();
      }()),
      queue_depth_(std::max(1u, queue_depth)) {}

absl::Status FakeFileIo::Run(absl::Span<IoOp> ops) {
  MutexLock lock(&mu_);
  if (delay_ > absl::ZeroDuration()) absl::SleepFor(delay_);  // the slow disk it stands for
  MutexLock data(&storage_->mu);
  submissions_ += (ops.size() + queue_depth_ - 1) / queue_depth_;
  for (IoOp& op : ops) {
    if (op.offset % kIoAlign != 0 || op.len % kIoAlign != 0 ||
        reinterpret_cast<uintptr_t>(op.buf) % kIoAlign != 0) {
      op.result = -EINVAL;  // as O_DIRECT answers
      continue;
    }
    if (op.offset >= size_) {
      op.result = op.kind == IoOp::kRead ? 0 : -ENOSPC;
      continue;
    }
    size_t n = std::min<uint64_t>(op.len, size_ - op.offset);
    if (op.kind == IoOp::kRead) {
      ++reads_;
      if (read_error_ != 0) {
        op.result = -read_error_;
        continue;
      }
      std::memcpy(op.buf, storage_->bytes.data() + op.offset, n);
    } else {
      ++writes_;
      if (write_error_ != 0) {
        op.result = -write_error_;
        continue;
      }
      size_t stored = n;
      if (tear_next_ >= 0) {
        stored = std::min<size_t>(n, static_cast<size_t>(tear_next_));
        tear_next_ = -1;
      }
      std::memcpy(storage_->bytes.data() + op.offset, op.buf, stored);
    }
    op.result = static_cast<int64_t>(n);
  }
  return absl::OkStatus();
}

uint64_t FakeFileIo::submissions() const {
  MutexLock lock(&mu_);
  return submissions_;
}

void FakeFileIo::FailOps(IoOp::Kind kind, int err) {
  MutexLock lock(&mu_);
  (kind == IoOp::kRead ? read_error_ : write_error_) = err;
}

void FakeFileIo::TearNextWrite(size_t bytes) {
  MutexLock lock(&mu_);
  tear_next_ = static_cast<int64_t>(bytes);
}

void FakeFileIo::Delay(absl::Duration d) {
  MutexLock lock(&mu_);
  delay_ = d;
}

uint64_t FakeFileIo::reads() const {
  MutexLock lock(&mu_);
  return reads_;
}

uint64_t FakeFileIo::writes() const {
  MutexLock lock(&mu_);
  return writes_;
}

}  // namespace tierkv::io
