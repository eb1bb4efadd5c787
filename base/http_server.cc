#include "base/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/log.h"
#include "base/signals.h"
#include "base/status.h"

namespace tierkv {

// One client connection. `buf[pos..]` holds bytes read past the end of the
// last request (a pipelining client), so none is lost between requests.
struct HttpServer::Conn {
  ~Conn() {
    if (ssl != nullptr) SSL_free(ssl);
  }
  int fd = -1;
  SSL* ssl = nullptr;  // with TLS; `buf` then holds decrypted bytes
  bool handshaken = false;
  std::string buf;
  size_t pos = 0;
  absl::Time last_active;
  bool parked = false;
  bool lingering = false;  // answered and shut for writing; reading what is left until the peer closes
  absl::Time head_since;  // plain: when the first bytes of the request being read ahead came
};

namespace {

void PeerOf(int fd, bool local, std::string& ip, int& port) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  int rc = local ? ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len)
                 : ::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ip.clear();
  port = -1;
  if (rc != 0) return;
  char text[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &a->sin_addr, text, sizeof(text));
    port = ntohs(a->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&addr);
    ::inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof(text));
    port = ntohs(a->sin6_port);
  }
  ip = text;
}

// How long a closed connection's last bytes are read before the socket goes.
constexpr absl::Duration kLinger = absl::Seconds(2);

int PollMs(absl::Duration d) {
  return static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(d)));
}

// A plain connection's request is read ahead in the poller, without
// waiting, until it is whole: a peer that trickles its headers (or a small
// body) then holds no worker, only its own connection, and is closed when
// it has not finished within the request timeout. Bodies above this size,
// chunked ones, and requests that expect a "100 Continue" go to a worker
// once their head is in.
constexpr size_t kMaxReadAhead = 64 << 10;

bool RequestWhole(std::string_view b) {
  // The blank line that ends the head (a bare LF is taken too, as httplib does).
  size_t head = b.find("\r\n\r\n");
  head = head == std::string_view::npos ? head : head + 4;
  if (size_t lf = b.find("\n\n"); lf != std::string_view::npos) head = std::min(head, lf + 2);
  if (head == std::string_view::npos) return b.size() > kMaxReadAhead;  // httplib refuses it
  std::string lower(b.substr(0, head));
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower.find("\nexpect:") != std::string::npos || lower.find("\ntransfer-encoding:") != std::string::npos) {
    return true;
  }
  const size_t at = lower.find("\ncontent-length:");
  if (at == std::string::npos) return true;
  uint64_t length = 0;
  for (size_t i = at + 16; i < lower.size() && (lower[i] == ' ' || std::isdigit(static_cast<unsigned char>(lower[i])));
       ++i) {
    if (lower[i] != ' ') length = std::min<uint64_t>(length * 10 + (lower[i] - '0'), kMaxReadAhead + 1);
  }
  return length > kMaxReadAhead || b.size() - head >= length;
}

// Reads what `fd` holds without waiting into `buf` (after its unread bytes
// from `pos`). True when a worker should take the connection: its request
// is whole, or the peer closed or failed (the worker finds out and closes).
bool ReadAhead(int fd, std::string& buf, size_t& pos) {
  buf.erase(0, pos);
  pos = 0;
  char chunk[16384];
  for (int i = 0; i < 16 && buf.size() <= kMaxReadAhead; ++i) {
    ssize_t n = ::recv(fd, chunk, sizeof(chunk), MSG_DONTWAIT);
    if (n > 0) {
      buf.append(chunk, static_cast<size_t>(n));
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      break;
    } else if (!(n < 0 && errno == EINTR)) {
      return true;
    }
  }
  return RequestWhole(buf);
}

}  // namespace

// A connection's socket, with every wait bounded by the request deadline.
class HttpServer::SocketStream final : public httplib::Stream {
 public:
  SocketStream(Conn* conn, absl::Time deadline) : conn_(conn), deadline_(deadline) {}

  bool is_readable() const override { return Wait(POLLIN); }
  bool is_writable() const override { return Wait(POLLOUT); }

  ssize_t read(char* ptr, size_t size) override {
    if (conn_->pos == conn_->buf.size()) {
      conn_->buf.resize(conn_->ssl != nullptr ? 16384 : 4096);  // TLS: a whole record
      conn_->pos = 0;
      ssize_t n = conn_->ssl != nullptr ? ReadTls() : ReadPlain();
      conn_->buf.resize(n > 0 ? static_cast<size_t>(n) : 0);
      if (n <= 0) return n;
    }
    size_t take = std::min(size, conn_->buf.size() - conn_->pos);
    std::memcpy(ptr, conn_->buf.data() + conn_->pos, take);
    conn_->pos += take;
    return static_cast<ssize_t>(take);
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (conn_->ssl != nullptr) return WriteTls(ptr, size);
    size_t done = 0;
    while (done < size) {
      ssize_t n = ::send(conn_->fd, ptr + done, size - done, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        done += static_cast<size_t>(n);
      } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
        if (!Wait(POLLOUT)) return -1;
      } else {
        return -1;
      }
    }
    return static_cast<ssize_t>(size);
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override { PeerOf(conn_->fd, false, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { PeerOf(conn_->fd, true, ip, port); }
  socket_t socket() const override { return conn_->fd; }

 private:
  ssize_t ReadPlain() {
    ssize_t n;
    do {
      if (!Wait(POLLIN)) return -1;
      n = ::recv(conn_->fd, conn_->buf.data(), conn_->buf.size(), MSG_DONTWAIT);
    } while (n < 0 && (errno == EAGAIN || errno == EINTR));
    return n;
  }

  ssize_t ReadTls() {
    for (;;) {
      ERR_clear_error();
      int n = SSL_read(conn_->ssl, conn_->buf.data(), static_cast<int>(conn_->buf.size()));
      if (n > 0) return n;
      int err = SSL_get_error(conn_->ssl, n);
      if (err == SSL_ERROR_ZERO_RETURN) return 0;
      if (!TlsWait(err)) return -1;
    }
  }

  ssize_t WriteTls(const char* ptr, size_t size) {
    size_t done = 0;
    while (done < size) {
      ERR_clear_error();
      int n = SSL_write(conn_->ssl, ptr + done, static_cast<int>(std::min<size_t>(size - done, 1 << 20)));
      if (n > 0) {
        done += static_cast<size_t>(n);
      } else if (!TlsWait(SSL_get_error(conn_->ssl, n))) {
        return -1;
      }
    }
    return static_cast<ssize_t>(size);
  }

 public:
  // Waits for what OpenSSL's `err` asks for; false for any other error or
  // past the deadline.
  bool TlsWait(int err) const {
    if (err == SSL_ERROR_WANT_READ) return Wait(POLLIN);
    if (err == SSL_ERROR_WANT_WRITE) return Wait(POLLOUT);
    return false;
  }

 private:
  bool Wait(short events) const {
    pollfd p{conn_->fd, events, 0};
    for (;;) {
      int rc = ::poll(&p, 1, PollMs(deadline_ - absl::Now()));
      if (rc > 0) return true;
      if (rc == 0 || errno != EINTR) return false;
    }
  }

  Conn* conn_;
  absl::Time deadline_;
};

// Bytes in, bytes out: the same request handling with no socket.
class HttpServer::MemoryStream final : public httplib::Stream {
 public:
  explicit MemoryStream(std::string_view in) : in_(in) {}
  bool is_readable() const override { return true; }
  bool is_writable() const override { return true; }
  ssize_t read(char* ptr, size_t size) override {
    size_t take = std::min(size, in_.size() - pos_);
    std::memcpy(ptr, in_.data() + pos_, take);
    pos_ += take;
    return static_cast<ssize_t>(take);
  }
  ssize_t write(const char* ptr, size_t size) override {
    out_.append(ptr, size);
    return static_cast<ssize_t>(size);
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip = "127.0.0.1";
    port = 1;
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    ip = "127.0.0.1";
    port = 2;
  }
  socket_t socket() const override { return -1; }
  bool drained() const { return pos_ == in_.size(); }
  std::string& out() { return out_; }

 private:
  std::string_view in_;
  size_t pos_ = 0;
  std::string out_;
};

HttpServer::HttpServer(Options options) : options_(options) {
  if (!options_.tls.cert.empty() || !options_.tls.key.empty()) {
    absl::StatusOr<std::unique_ptr<auth::ServerTlsContext>> tls =
        auth::ServerTlsContext::Create(options_.tls, "HTTP", [](SSL_CTX* ctx, const auth::TlsFiles& files) {
          // Writes may take what the socket accepts and retry from a moved buffer.
          SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
          static constexpr unsigned char kSessionContext[] = "tierkv-http";
          SSL_CTX_set_session_id_context(ctx, kSessionContext, sizeof(kSessionContext) - 1);
          if (files.ca.empty()) return true;
          // Asked for, verified when sent; a request without one is the
          // routes' call (a probe of /health need not carry one).
          if (SSL_CTX_load_verify_locations(ctx, files.ca.c_str(), nullptr) != 1) return false;
          SSL_CTX_set_client_CA_list(ctx, SSL_load_client_CA_file(files.ca.c_str()));
          SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
          // Every connection shows its certificate afresh: a resumed session
          // would keep admitting one that has since expired.
          SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
          SSL_CTX_set_num_tickets(ctx, 0);
          return true;
        });
    if (tls.ok()) {
      tls_ = *std::move(tls);
    } else {
      tls_status_ = tls.status();
    }
  }
  // httplib's own pool only hands accepted sockets over; that never blocks.
  new_task_queue = [] { return new httplib::ThreadPool(1); };
  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  poller_ = std::thread([this] { PollLoop(); });
  for (int i = 0; i < std::max(1, options_.threads); ++i) workers_.emplace_back([this] { WorkLoop(); });
}

void HttpServer::Start(absl::Duration wait) {
  serving_ = std::thread([this] {
    listen_after_bind();
    served_.store(true);
  });
  const absl::Time deadline = absl::Now() + wait;
  while (!is_running() && !served_.load() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  if (!is_running() && wait > absl::ZeroDuration()) TKV_LOG(WARNING) << "the HTTP server is slow to start";
}

void HttpServer::Stop() {
  if (!serving_.joinable()) return;
  // The loop either runs (stop() ends it) or returns on its own (a failed
  // listen); wait for one of the two, so stop() is never lost.
  const absl::Time warn_at = absl::Now() + absl::Seconds(10);
  bool warned = false;
  while (!is_running() && !served_.load()) {
    if (!warned && absl::Now() > warn_at) {
      TKV_LOG(WARNING) << "the HTTP server's loop has not started after 10 s; still waiting to stop it";
      warned = true;
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  stop();
  serving_.join();
}

HttpServer::~HttpServer() {
  Stop();
  stop();
  stopping_.store(true);
  uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
  {
    MutexLock lock(&mu_);
    cv_.SignalAll();
  }
  poller_.join();
  for (auto& t : workers_) t.join();
  MutexLock lock(&mu_);
  for (auto& [fd, conn] : conns_) ::close(fd);
  conns_.clear();
  ::close(wake_fd_);
  ::close(epoll_fd_);
}

int HttpServer::Bind(const std::string& host, int port) {
  int bound = port == 0 ? bind_to_any_port(host) : (bind_to_port(host, port) ? port : -1);
  if (bound > 0) ::listen(svr_sock_, SOMAXCONN);
  return bound;
}

bool HttpServer::process_and_close_socket(socket_t sock) {
  if (stopping_.load() || open_.load() >= options_.max_connections) {
    static constexpr char kBusy[] =
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
        "Content-Length: 36\r\n\r\n{\"error\": \"too many open connections\"}";
    (void)::send(sock, kBusy, sizeof(kBusy) - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    ::close(sock);
    return true;
  }
  auto conn = std::make_unique<Conn>();
  conn->fd = sock;
  if (tls()) {
    conn->ssl = tls_ != nullptr ? SSL_new(tls_->Current().get()) : nullptr;
    if (conn->ssl == nullptr) {
      ::close(sock);  // TLS did not load: serve nothing in the clear
      return true;
    }
    // Nonblocking, so OpenSSL reports what it waits for instead of blocking.
    ::fcntl(sock, F_SETFL, ::fcntl(sock, F_GETFL) | O_NONBLOCK);
    SSL_set_fd(conn->ssl, sock);
    SSL_set_accept_state(conn->ssl);
  }
  Conn* raw = conn.get();
  {
    MutexLock lock(&mu_);
    conns_[sock] = std::move(conn);
  }
  open_.fetch_add(1);
  Park(raw);
  return true;
}

void HttpServer::Park(Conn* conn) {
  conn->last_active = absl::Now();
  MutexLock lock(&mu_);
  conn->parked = true;
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT;
  ev.data.ptr = conn;
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, conn->fd, &ev) != 0 &&
      ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, conn->fd, &ev) != 0) {
    conn->parked = false;
    ready_.push_back(conn);  // a worker will find it unreadable and close it
    cv_.Signal();
  }
}

void HttpServer::Close(Conn* conn) {
  if (conn->ssl != nullptr && conn->handshaken) {
    ERR_clear_error();
    SSL_shutdown(conn->ssl);  // one try: a close_notify if the socket takes it
  }
  // Closing a socket with unread bytes in it resets the connection, and a
  // peer that gets the reset before it has read our answer loses it (a TLS
  // client sends a request's body in a record of its own, which a refused
  // request leaves unread). So: shut for writing, and read what the peer
  // still sends until it closes (or kLinger passes) in the poller.
  ::shutdown(conn->fd, SHUT_WR);
  MutexLock lock(&mu_);
  conn->lingering = true;
  conn->parked = true;
  conn->last_active = absl::Now();
  if (Drain(conn)) return;
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT;
  ev.data.ptr = conn;
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, conn->fd, &ev) != 0 &&
      ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, conn->fd, &ev) != 0) {
    Release(conn);
  }
}

bool HttpServer::Drain(Conn* conn) {
  char scratch[4096];
  // Bounded per call (the lock is held): a peer still sending is read on
  // later wake-ups, until it closes or kLinger passes.
  for (int i = 0; i < 16; ++i) {
    ssize_t n = ::recv(conn->fd, scratch, sizeof(scratch), MSG_DONTWAIT);
    if (n > 0 || (n < 0 && errno == EINTR)) continue;
    if (n < 0 && errno == EAGAIN) return false;
    Release(conn);  // the peer closed (or the socket failed)
    return true;
  }
  return false;
}

void HttpServer::Release(Conn* conn) {
  // Under the lock: once the fd is closed its number may be reused by the
  // next accepted connection, which must not find this entry.
  const int fd = conn->fd;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  ::close(fd);
  conns_.erase(fd);
  open_.fetch_sub(1);
}

void HttpServer::PollLoop() {
  std::vector<epoll_event> events(256);
  absl::Time last_sweep = absl::Now();
  while (!stopping_.load()) {
    int n = ::epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()), 250);
    MutexLock lock(&mu_);
    for (int i = 0; i < n; ++i) {
      auto* conn = static_cast<Conn*>(events[i].data.ptr);
      if (conn == nullptr || !conn->parked) continue;
      if (conn->lingering) {
        if (!Drain(conn)) {
          epoll_event ev{};
          ev.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT;
          ev.data.ptr = conn;
          if (::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, conn->fd, &ev) != 0) Release(conn);
        }
        continue;
      }
      if (conn->ssl == nullptr) {
        const bool fresh = conn->buf.size() == conn->pos;
        const bool whole = ReadAhead(conn->fd, conn->buf, conn->pos);
        if (fresh && !conn->buf.empty()) conn->head_since = absl::Now();
        if (!whole) {
          epoll_event ev{};
          ev.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT;
          ev.data.ptr = conn;
          if (::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, conn->fd, &ev) != 0) Release(conn);
          continue;
        }
      }
      conn->parked = false;
      ready_.push_back(conn);
      cv_.Signal();
    }
    // Idle connections past their timeout go; a sweep a second is plenty.
    absl::Time now = absl::Now();
    if (now - last_sweep < absl::Seconds(1)) continue;
    last_sweep = now;
    std::vector<Conn*> expired;
    for (auto& [fd, c] : conns_) {
      const absl::Duration limit = c->lingering ? std::min(kLinger, options_.idle_timeout) : options_.idle_timeout;
      // A request read ahead (plain) must be whole within the request timeout.
      const bool late = c->parked && !c->lingering && c->ssl == nullptr && c->pos < c->buf.size() &&
                        now - c->head_since > options_.request_timeout;
      if ((c->parked && now - c->last_active > limit) || late) expired.push_back(c.get());
    }
    for (Conn* c : expired) Release(c);
  }
}

void HttpServer::WorkLoop() {
  for (;;) {
    Conn* conn = nullptr;
    {
      MutexLock lock(&mu_);
      while (ready_.empty() && !stopping_.load()) cv_.WaitFor(&mu_, std::chrono::milliseconds(250));
      if (stopping_.load()) return;
      conn = ready_.front();
      ready_.pop_front();
    }
    ServeConn(conn);
  }
}

bool HttpServer::Handshake(Conn* conn) {
  SocketStream strm(conn, absl::Now() + options_.request_timeout);
  for (;;) {
    ERR_clear_error();
    int rc = SSL_do_handshake(conn->ssl);
    if (rc == 1) break;
    int err = SSL_get_error(conn->ssl, rc);
    if (!strm.TlsWait(err)) {
      tls_failures_.fetch_add(1);
      std::string ip;
      int port = 0;
      PeerOf(conn->fd, false, ip, port);
      char why[256] = "timed out or closed";
      if (unsigned long e = ERR_peek_error(); e != 0) ERR_error_string_n(e, why, sizeof(why));
      TKV_LOG(INFO) << "HTTP TLS handshake with " << ip << ":" << port << " failed: " << why;
      return false;
    }
  }
  conn->handshaken = true;
  return true;
}

void HttpServer::ServeConn(Conn* conn) {
  if (conn->ssl != nullptr && !conn->handshaken) {
    if (!Handshake(conn)) {
      Close(conn);
      return;
    }
    if (SSL_pending(conn->ssl) == 0) {
      Park(conn);  // the first request is yet to come
      return;
    }
  }
  auto setup = [conn](httplib::Request& req) { req.ssl = conn->ssl; };
  // Requests already buffered (pipelined, or decrypted by TLS) are served
  // without waiting.
  do {
    SocketStream strm(conn, absl::Now() + options_.request_timeout);
    bool closed = false;
    bool ok = process_request(strm, /*close_connection=*/stopping_.load(), closed, setup);
    if (!ok || closed || stopping_.load()) {
      Close(conn);
      return;
    }
    // Plain: a pipelined request only once it is whole (the poller reads
    // the rest ahead, so a trickled one holds no worker).
  } while (conn->ssl != nullptr ? conn->pos < conn->buf.size() || SSL_pending(conn->ssl) > 0
                                : RequestWhole(std::string_view(conn->buf).substr(conn->pos)) &&
                                      conn->pos < conn->buf.size());
  if (conn->ssl == nullptr && conn->pos < conn->buf.size()) conn->head_since = absl::Now();
  // Nothing buffered: a peer that hung up is found by the next recv.
  Park(conn);
}

std::string HttpServer::ServeBytes(std::string_view request) {
  MemoryStream strm(request);
  // Like a keep-alive connection: serve requests until the bytes run out
  // or the handler closes it; a bounded count keeps a fuzzer's run short.
  for (int i = 0; i < 64 && !strm.drained(); ++i) {
    bool closed = false;
    if (!process_request(strm, false, closed, nullptr) || closed) break;
  }
  return std::move(strm.out());
}

}  // namespace tierkv
