// Readiness notifications to a service manager (systemd's sd_notify
// protocol, Type=notify units). Each call sends one datagram to
// $NOTIFY_SOCKET; with NOTIFY_SOCKET unset (not run by systemd) it does
// nothing and returns false, so daemons call them unconditionally.
//
// Daemons send READY=1 only once they are useful (the master once it
// serves, a store daemon once its segment is mounted at the master), and
// STOPPING=1 when a stop signal starts their drain.
#pragma once

#include <string_view>

namespace tierkv {

// READY=1 with a STATUS= line for `systemctl status`.
bool NotifyReady(std::string_view status);
// STOPPING=1, at the start of a graceful shutdown.
bool NotifyStopping();
// STATUS= alone (e.g. "master unreachable" after the daemon was ready).
bool NotifyStatus(std::string_view status);

}  // namespace tierkv
