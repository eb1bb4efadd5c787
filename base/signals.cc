#include "base/signals.h"

#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>

namespace tierkv {
namespace {
sigset_t StopSet() {
  sigset_t s;
  sigemptyset(&s);
  sigaddset(&s, SIGTERM);
  sigaddset(&s, SIGINT);
  sigaddset(&s, SIGHUP);
  return s;
}
}  // namespace

void BlockStopSignals() {
  sigset_t s = StopSet();
  pthread_sigmask(SIG_BLOCK, &s, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

int WaitForStopSignal(const std::function<void()>& on_reload) {
  sigset_t s = StopSet();
  for (;;) {
    int sig = 0;
    if (sigwait(&s, &sig) != 0) continue;
    if (sig != SIGHUP) return sig;
    if (on_reload) on_reload();
  }
}

long RaiseFileLimit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return -1;
  if (lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    (void)::setrlimit(RLIMIT_NOFILE, &lim);
    (void)::getrlimit(RLIMIT_NOFILE, &lim);
  }
  return static_cast<long>(lim.rlim_cur);
}

void IgnoreSigpipeUnlessHandled() {
  static const bool done = [] {
    struct sigaction old {};
    if (sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);
    return true;
  }();
  (void)done;
}

}  // namespace tierkv
