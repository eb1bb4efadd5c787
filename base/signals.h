// Stop signals for daemons: block SIGTERM/SIGINT in every thread (call
// before starting any), then wait for one in main. SIGPIPE is ignored, so
// a peer that vanishes mid-write is an error return, not a death. Also
// the process-wide limits a daemon needs.
#pragma once

#include <functional>

namespace tierkv {

// Also blocks SIGHUP, which WaitForStopSignal turns into `on_reload`.
void BlockStopSignals();
// Blocks until SIGTERM or SIGINT arrives; returns its number. Each SIGHUP
// meanwhile calls `on_reload` (when given) on the waiting thread.
int WaitForStopSignal(const std::function<void()>& on_reload = nullptr);
// Raises the open-file limit to its hard maximum: a server holds a socket
// per client connection, and the common soft limit of 1024 is too few.
// Returns the new soft limit.
long RaiseFileLimit();
// Ignores SIGPIPE if the process left it at its default. OpenSSL writes to
// its sockets without MSG_NOSIGNAL, so a peer that hangs up mid-write
// would otherwise kill a program linking our TLS clients or servers; a
// handler the program installed is left alone. Idempotent, thread-safe.
void IgnoreSigpipeUnlessHandled();

}  // namespace tierkv
