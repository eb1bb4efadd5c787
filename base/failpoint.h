// Failpoints: named places where a test can make the process fail on
// purpose, switched on by the TIERKV_FAILPOINTS environment variable:
//
//   TIERKV_FAILPOINTS=client.put.before_end=abort,master.persist.write=error
//
// Actions: `abort` kills the process on the spot (as a crash would),
// `error` makes TIERKV_FAILPOINT return true so the caller fails the
// operation, `sleep:<ms>` stalls there. With the variable unset a
// failpoint costs one load of a static flag. Builds without tests (and any
// configured with -DTIERKV_FAILPOINTS=OFF) compile every failpoint out.
//
// The failpoints: client.put.after_start, client.put.before_end,
// transport.tcp.serve, master.persist.write, master.rpc.put_start,
// master.rpc.put_end, master.ha.initialized,
// master.direct.drop_reply,
// store.heartbeat,
// store.ssd.direct, store.ssd.scan, store.ssd.write, store.ssd.write_full,
// store.ssd.read (docs/faults.md says where each sits).
//
//   if (TIERKV_FAILPOINT("master.persist.write")) return absl::InternalError("failpoint");
#pragma once

namespace tierkv {

// True when `name` is set to `error`; aborts or sleeps for those actions.
bool FailpointHit(const char* name);
bool FailpointsActive();

}  // namespace tierkv

#ifdef TIERKV_NO_FAILPOINTS
#define TIERKV_FAILPOINT(name) false
#else
#define TIERKV_FAILPOINT(name) (::tierkv::FailpointsActive() && ::tierkv::FailpointHit(name))
#endif
