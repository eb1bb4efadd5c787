// Whether this build runs under a sanitizer (ASan or TSan): their runtimes
// change what some tests measure (memory grows, mlock is a no-op).
#pragma once

namespace tierkv::testing {

inline constexpr bool kSanitized =
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
    true;
#else
    false;
#endif
#else
    false;
#endif

}  // namespace tierkv::testing
