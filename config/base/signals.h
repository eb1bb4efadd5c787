// Stop signals for daemons: block SIGTERM/SIGINT in every thread (call
// before starting any), then wait for one in main. SIGPIPE is ignored, so
// a peer that vanishes mid-write is an error return, not a death.
#pragma once

namespace tierkv {

void BlockStopSignals();
// Blocks until SIGTERM or SIGINT arrives; returns its number.
int WaitForStopSignal();

}  // namespace tierkv
