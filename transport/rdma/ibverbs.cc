// Verbs over libibverbs (rdma-core). Built everywhere; on machines without
// an RDMA NIC, Ports() is empty and nothing here runs.
#include <infiniband/verbs.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/mutex.h"
#include "transport/rdma/verbs.h"

namespace tierkv::transport::rdma {
namespace {

int MtuBytes(ibv_mtu m) {
  switch (m) {
    case IBV_MTU_256: return 256;
    case IBV_MTU_512: return 512;
    case IBV_MTU_1024: return 1024;
    case IBV_MTU_2048: return 2048;
    case IBV_MTU_4096: return 4096;
  }
  return 1024;
}

ibv_mtu MtuEnum(int bytes) {
  if (bytes >= 4096) return IBV_MTU_4096;
  if (bytes >= 2048) return IBV_MTU_2048;
  if (bytes >= 1024) return IBV_MTU_1024;
  if (bytes >= 512) return IBV_MTU_512;
  return IBV_MTU_256;
}

absl::Status Errno(const char* what, int err) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(err)));
}

WcStatus FromWc(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_SUCCESS: return WcStatus::kSuccess;
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_REM_INV_REQ_ERR: return WcStatus::kRemoteAccess;
    case IBV_WC_WR_FLUSH_ERR: return WcStatus::kFlushed;
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_LOC_LEN_ERR:
    case IBV_WC_LOC_QP_OP_ERR: return WcStatus::kLocal;
    default: return WcStatus::kTransport;
  }
}

class IbQueuePair final : public QueuePair {
 public:
  IbQueuePair(ibv_qp* qp, const PortInfo& port, uint32_t psn) : qp_(qp), port_(port), psn_(psn) {}
  ~IbQueuePair() override { ibv_destroy_qp(qp_); }

  QpAddress address() const override {
    return {qp_->qp_num, port_.lid, port_.gid, psn_, port_.mtu};
  }

  absl::Status Connect(const QpAddress& remote) override {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = MtuEnum(std::min(port_.mtu, remote.mtu));
    a.dest_qp_num = remote.qp_num;
    a.rq_psn = remote.psn;
    a.max_dest_rd_atomic = 16;
    a.min_rnr_timer = 12;
    a.ah_attr.dlid = remote.lid;
    a.ah_attr.port_num = static_cast<uint8_t>(port_.port);
    bool roce = std::any_of(remote.gid.begin(), remote.gid.end(), [](uint8_t b) { return b != 0; });
    if (roce) {
      a.ah_attr.is_global = 1;
      std::memcpy(a.ah_attr.grh.dgid.raw, remote.gid.data(), 16);
      a.ah_attr.grh.sgid_index = static_cast<uint8_t>(port_.gid_index);
      a.ah_attr.grh.hop_limit = 64;
    }
    int rc = ibv_modify_qp(qp_, &a,
                           IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                               IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (rc != 0) return Errno("ibv_modify_qp(RTR)", rc);
    ibv_qp_attr r{};
    r.qp_state = IBV_QPS_RTS;
    r.timeout = 14;  // 4.096 us * 2^14 = 67 ms per attempt
    r.retry_cnt = 7;
    r.rnr_retry = 7;
    r.sq_psn = psn_;
    r.max_rd_atomic = 16;
    rc = ibv_modify_qp(qp_, &r,
                       IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                           IBV_QP_MAX_QP_RD_ATOMIC);
    if (rc != 0) return Errno("ibv_modify_qp(RTS)", rc);
    return absl::OkStatus();
  }

  absl::Status Post(const WorkRequest& wr) override {
    ibv_sge sge{reinterpret_cast<uint64_t>(wr.local), wr.length, wr.lkey};
    ibv_send_wr w{};
    w.wr_id = wr.wr_id;
    w.sg_list = &sge;
    w.num_sge = 1;
    w.opcode = wr.write ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
    w.send_flags = IBV_SEND_SIGNALED;
    w.wr.rdma.remote_addr = wr.remote_addr;
    w.wr.rdma.rkey = wr.rkey;
    ibv_send_wr* bad = nullptr;
    int rc = ibv_post_send(qp_, &w, &bad);
    if (rc != 0) return Errno("ibv_post_send", rc);
    return absl::OkStatus();
  }

  void Fail() override {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_ERR;
    ibv_modify_qp(qp_, &a, IBV_QP_STATE);
  }

 private:
  ibv_qp* qp_;
  PortInfo port_;
  uint32_t psn_;
};

class IbDevice final : public Device {
 public:
  IbDevice(ibv_context* ctx, ibv_pd* pd, ibv_cq* cq, PortInfo port) : ctx_(ctx), pd_(pd), cq_(cq), port_(std::move(port)) {}
  ~IbDevice() override {
    {
      MutexLock lock(&mu_);
      for (auto& [addr, mr] : mrs_) ibv_dereg_mr(mr);
    }
    ibv_destroy_cq(cq_);
    ibv_dealloc_pd(pd_);
    ibv_close_device(ctx_);
  }
  const PortInfo& port() const override { return port_; }

  absl::StatusOr<MemoryKeys> Register(char* addr, uint64_t length) override {
    ibv_mr* mr = ibv_reg_mr(pd_, addr, length,
                           IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
    if (mr == nullptr) return Errno(absl::StrCat("ibv_reg_mr on ", port_.device).c_str(), errno);
    MutexLock lock(&mu_);
    mrs_[addr] = mr;
    return MemoryKeys{mr->lkey, mr->rkey};
  }

  void Deregister(char* addr) override {
    MutexLock lock(&mu_);
    auto it = mrs_.find(addr);
    if (it == mrs_.end()) return;
    ibv_dereg_mr(it->second);
    mrs_.erase(it);
  }

  absl::StatusOr<std::unique_ptr<QueuePair>> CreateQueuePair(int max_outstanding) override {
    ibv_qp_init_attr init{};
    init.send_cq = cq_;
    init.recv_cq = cq_;
    init.qp_type = IBV_QPT_RC;
    init.cap.max_send_wr = static_cast<uint32_t>(max_outstanding);
    init.cap.max_recv_wr = 1;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    ibv_qp* qp = ibv_create_qp(pd_, &init);
    if (qp == nullptr) return Errno(absl::StrCat("ibv_create_qp on ", port_.device).c_str(), errno);
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = static_cast<uint8_t>(port_.port);
    a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
    int rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    if (rc != 0) {
      ibv_destroy_qp(qp);
      return Errno("ibv_modify_qp(INIT)", rc);
    }
    static thread_local std::mt19937 rng(std::random_device{}());
    return std::unique_ptr<QueuePair>(new IbQueuePair(qp, port_, rng() & 0xffffff));
  }

  int Poll(Completion* out, int max, absl::Duration timeout) override {
    absl::Time deadline = absl::Now() + timeout;
    std::vector<ibv_wc> wc(static_cast<size_t>(max));
    for (;;) {
      int n = ibv_poll_cq(cq_, max, wc.data());
      if (n > 0) {
        for (int i = 0; i < n; ++i) {
          out[i] = {wc[i].wr_id, FromWc(wc[i].status), ibv_wc_status_str(wc[i].status)};
        }
        return n;
      }
      if (n < 0 || absl::Now() >= deadline) return 0;
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

 private:
  ibv_context* ctx_;
  ibv_pd* pd_;
  ibv_cq* cq_;
  PortInfo port_;
  Mutex mu_;
  std::map<char*, ibv_mr*> mrs_ ABSL_GUARDED_BY(mu_);
};

class IbVerbs final : public Verbs {
 public:
  std::vector<PortInfo> Ports() override {
    std::vector<PortInfo> out;
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    if (list == nullptr) return out;
    for (int i = 0; i < n; ++i) {
      ibv_context* ctx = ibv_open_device(list[i]);
      if (ctx == nullptr) continue;
      ibv_device_attr dev{};
      if (ibv_query_device(ctx, &dev) == 0) {
        for (int p = 1; p <= dev.phys_port_cnt; ++p) {
          ibv_port_attr pa{};
          if (ibv_query_port(ctx, static_cast<uint8_t>(p), &pa) != 0) continue;
          PortInfo info;
          info.device = ibv_get_device_name(list[i]);
          info.port = p;
          info.active = pa.state == IBV_PORT_ACTIVE;
          info.lid = pa.lid;
          info.mtu = MtuBytes(pa.active_mtu);
          info.numa_node = NumaNodeOf(info.device);
          // RoCE needs a GID; index 0 is the link-local one every port has.
          ibv_gid gid{};
          if (pa.link_layer == IBV_LINK_LAYER_ETHERNET && ibv_query_gid(ctx, static_cast<uint8_t>(p), 0, &gid) == 0) {
            std::memcpy(info.gid.data(), gid.raw, 16);
          }
          out.push_back(info);
        }
      }
      ibv_close_device(ctx);
    }
    ibv_free_device_list(list);
    return out;
  }

  absl::StatusOr<std::unique_ptr<Device>> Open(const PortInfo& port) override {
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    if (list == nullptr) return absl::UnavailableError("ibv_get_device_list found no RDMA device");
    ibv_context* ctx = nullptr;
    for (int i = 0; i < n && ctx == nullptr; ++i) {
      if (port.device == ibv_get_device_name(list[i])) ctx = ibv_open_device(list[i]);
    }
    ibv_free_device_list(list);
    if (ctx == nullptr) return absl::UnavailableError(absl::StrCat("cannot open RDMA device ", port.device));
    ibv_pd* pd = ibv_alloc_pd(ctx);
    ibv_cq* cq = pd != nullptr ? ibv_create_cq(ctx, 4096, nullptr, nullptr, 0) : nullptr;
    if (cq == nullptr) {
      if (pd != nullptr) ibv_dealloc_pd(pd);
      ibv_close_device(ctx);
      return absl::UnavailableError(absl::StrCat("cannot set up ", port.device, ": ", std::strerror(errno)));
    }
    return std::unique_ptr<Device>(new IbDevice(ctx, pd, cq, port));
  }
};

}  // namespace

std::shared_ptr<Verbs> RealVerbs() {
  static std::shared_ptr<Verbs> verbs = std::make_shared<IbVerbs>();
  return verbs;
}

int NumaNodeOf(const std::string& ib_device) {
  std::ifstream f("/sys/class/infiniband/" + ib_device + "/device/numa_node");
  int node = -1;
  if (!(f >> node)) return -1;
  return node;
}

}  // namespace tierkv::transport::rdma
