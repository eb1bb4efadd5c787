#include "master/persistence.h"

#include <new>

#include <map>

#include "absl/strings/str_cat.h"
#include "base/failpoint.h"
#include "base/status.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "rocksdb/write_batch.h"

namespace tierkv::master {
namespace {

absl::Status FromRocks(const rocksdb::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  std::string msg = absl::StrCat(what, ": ", s.ToString());
  if (s.IsNotFound()) return absl::NotFoundError(msg);
  if (s.IsBusy() || s.IsTryAgain() || s.IsTimedOut()) return absl::UnavailableError(msg);
  if (s.IsCorruption()) return absl::DataLossError(msg);
  return absl::InternalError(msg);
}

class RocksDbStore final : public IndexStore {
 public:
  explicit RocksDbStore(std::unique_ptr<rocksdb::DB> db) : db_(std::move(db)) {}
  ~RocksDbStore() override { (void)Flush(); }

  // Group commit: a writer that finds another's write in flight queues its
  // mutations; when that write returns, the first queued writer applies
  // every queued batch as one WriteBatch, in arrival order, and answers
  // them all with its status. Each caller returns only once its own
  // mutations are in the log, as a lone write would, and, with a
  // replicator, once they are replicated as it asks.
  absl::Status Write(const std::vector<Mutation>& batch) override {
    ASSIGN_OR_RETURN(const uint64_t ticket, Commit(batch));
    return AwaitReplicated(ticket);
  }

  absl::StatusOr<uint64_t> Commit(const std::vector<Mutation>& batch) override {
    if (batch.empty()) return 0;
    Writer self{&batch};
    MutexLock lock(&mu_);
    queue_.push_back(&self);
    while (!self.done && leading_) cv_.WaitFor(&mu_, std::chrono::milliseconds(50));
    if (!self.done) Lead();
    if (!self.status.ok()) return self.status;
    return self.seq;
  }

  WriteCounts Counts() override {
    MutexLock lock(&mu_);
    return {writes_, batches_};
  }

  absl::StatusOr<std::string> Get(const std::string& key) override {
    std::string value;
    rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), key, &value);
    if (!s.ok()) return FromRocks(s, absl::StrCat("rocksdb get ", key));
    return value;
  }

  absl::Status Scan(const std::string& prefix,
                    const std::function<bool(absl::string_view, absl::string_view)>& fn) override {
    return Walk(prefix, /*past_start=*/false, prefix, fn);
  }

  absl::Status ScanAfter(const std::string& after,
                         const std::function<bool(absl::string_view, absl::string_view)>& fn) override {
    return Walk(after, /*past_start=*/true, "", fn);
  }

  absl::Status Flush() override { return FromRocks(db_->FlushWAL(/*sync=*/true), "rocksdb sync"); }

 private:
  struct Writer {
    const std::vector<Mutation>* batch;
    absl::Status status;
    bool done = false;
    uint64_t seq = 0;  // the replicated batch it went out in (0: none)
  };

  // Calls fn on keys from `start` (the keys after it when past_start) in
  // order, while they begin with `prefix`, until fn returns false.
  absl::Status Walk(const std::string& start, bool past_start, const std::string& prefix,
                    const std::function<bool(absl::string_view, absl::string_view)>& fn) {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
    it->Seek(start);
    if (past_start && it->Valid() && it->key() == rocksdb::Slice(start)) it->Next();
    for (; it->Valid() && it->key().starts_with(prefix); it->Next()) {
      if (!fn(absl::string_view(it->key().data(), it->key().size()), absl::string_view(it->value().data(), it->value().size()))) break;
    }
    return FromRocks(it->status(), "rocksdb scan");
  }

  // Applies every queued batch as one; the caller holds mu_ and is queued.
  void Lead() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    leading_ = true;
    std::vector<Writer*> group;
    group.swap(queue_);
    mu_.Unlock();
    absl::Status status;
    if (TIERKV_FAILPOINT("master.persist.write")) {
      status = absl::UnavailableError("failpoint master.persist.write");
    } else {
      // Caught here because a leader that left by an exception would leave
      // leading_ set and every later writer waiting on it forever.
      try {
        rocksdb::WriteBatch wb;
        for (const Writer* w : group) {
          for (const Mutation& m : *w->batch) {
            if (m.remove) {
              wb.Delete(m.key);
            } else {
              wb.Put(m.key, m.value);
            }
          }
        }
        status = FromRocks(db_->Write(rocksdb::WriteOptions(), &wb), "rocksdb write");
      } catch (const std::bad_alloc&) {
        status = absl::ResourceExhaustedError("rocksdb write: out of memory building the batch");
      }
    }
    // Handed on while this leader still holds the only write in flight,
    // so the replicated order is the applied order.
    uint64_t seq = 0;
    if (Replicator* r = replicator(); r != nullptr && status.ok()) {
      std::vector<const std::vector<Mutation>*> batches;
      batches.reserve(group.size());
      for (const Writer* w : group) batches.push_back(w->batch);
      seq = r->Append(batches);
    }
    mu_.Lock();
    for (Writer* w : group) {
      w->status = status;
      w->seq = seq;
      w->done = true;
    }
    ++batches_;
    writes_ += group.size();
    leading_ = false;
    cv_.SignalAll();
  }

  std::unique_ptr<rocksdb::DB> db_;
  Mutex mu_;
  CondVar cv_;
  std::vector<Writer*> queue_ ABSL_GUARDED_BY(mu_);
  bool leading_ ABSL_GUARDED_BY(mu_) = false;  // a write is in flight
  uint64_t writes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t batches_ ABSL_GUARDED_BY(mu_) = 0;
};

class MemStore final : public IndexStore {
 public:
  absl::Status Write(const std::vector<Mutation>& batch) override {
    ASSIGN_OR_RETURN(const uint64_t ticket, Commit(batch));
    return AwaitReplicated(ticket);
  }
  absl::StatusOr<uint64_t> Commit(const std::vector<Mutation>& batch) override {
    Replicator* r = replicator();
    MutexLock lock(&mu_);
    for (const Mutation& m : batch) {
      if (m.remove) {
        data_.erase(m.key);
      } else {
        data_[m.key] = m.value;
      }
    }
    return r != nullptr && !batch.empty() ? r->Append({&batch}) : 0;
  }
  absl::StatusOr<std::string> Get(const std::string& key) override {
    MutexLock lock(&mu_);
    auto it = data_.find(key);
    if (it == data_.end()) return absl::NotFoundError(key);
    return it->second;
  }
  absl::Status Scan(const std::string& prefix,
                    const std::function<bool(absl::string_view, absl::string_view)>& fn) override {
    std::vector<std::pair<std::string, std::string>> copy;
    {
      MutexLock lock(&mu_);
      for (auto it = data_.lower_bound(prefix);
           it != data_.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it) {
        copy.emplace_back(*it);
      }
    }
    for (auto& [k, v] : copy) {
      if (!fn(k, v)) break;
    }
    return absl::OkStatus();
  }
  absl::Status ScanAfter(const std::string& after,
                         const std::function<bool(absl::string_view, absl::string_view)>& fn) override {
    std::vector<std::pair<std::string, std::string>> copy;
    {
      MutexLock lock(&mu_);
      for (auto it = data_.upper_bound(after); it != data_.end(); ++it) copy.emplace_back(*it);
    }
    for (auto& [k, v] : copy) {
      if (!fn(k, v)) break;
    }
    return absl::OkStatus();
  }
  absl::Status Flush() override { return absl::OkStatus(); }

 private:
  Mutex mu_;
  std::map<std::string, std::string> data_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::Status IndexStore::ScanAfter(const std::string& after,
                                   const std::function<bool(absl::string_view, absl::string_view)>& fn) {
  return Scan("", [&](absl::string_view k, absl::string_view v) { return k <= after || fn(k, v); });
}

absl::StatusOr<std::unique_ptr<IndexStore>> OpenRocksDbStore(const std::string& dir) {
  rocksdb::Options options;
  options.create_if_missing = true;
  options.manual_wal_flush = false;
  options.max_background_jobs = 2;
  options.keep_log_file_num = 4;
  rocksdb::DB* db = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(options, dir, &db);
  if (!s.ok()) return FromRocks(s, absl::StrCat("opening rocksdb in ", dir));
  return std::unique_ptr<IndexStore>(new RocksDbStore(std::unique_ptr<rocksdb::DB>(db)));
}

std::unique_ptr<IndexStore> NewMemStore() { return std::make_unique<MemStore>(); }

}  // namespace tierkv::master
