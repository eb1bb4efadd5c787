#include "base/clock.h"

namespace tierkv {

Clock* Clock::Real() {
  static RealClock* clock = new RealClock();
  return clock;
}

}  // namespace tierkv
