#include "config/base/signals.h"

#include <pthread.h>
#include <signal.h>

namespace tierkv {
namespace {
sigset_t StopSet() {
  sigset_t s;
  sigemptyset(&s);
  sigaddset(&s, SIGTERM);
  sigaddset(&s, SIGINT);
  return s;
}
}  // namespace

void BlockStopSignals() {
  sigset_t s = StopSet();
  pthread_sigmask(SIG_BLOCK, &s, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

int WaitForStopSignal() {
  sigset_t s = StopSet();
  int sig = 0;
  sigwait(&s, &sig);
  return sig;
}

}  // namespace tierkv
