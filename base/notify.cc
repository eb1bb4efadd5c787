#include "base/notify.h"

#include <systemd/sd-daemon.h>

#include <string>

namespace tierkv {
namespace {

// sd_notify: >0 sent, 0 no NOTIFY_SOCKET, <0 send failed. A failed send
// must not stop a daemon: systemd then times the unit out on its own.
bool Send(const std::string& message) { return sd_notify(/*unset_environment=*/0, message.c_str()) > 0; }

}  // namespace

bool NotifyReady(std::string_view status) { return Send("READY=1\nSTATUS=" + std::string(status)); }

bool NotifyStopping() { return Send("STOPPING=1\nSTATUS=stopping"); }

bool NotifyStatus(std::string_view status) { return Send("STATUS=" + std::string(status)); }

}  // namespace tierkv
