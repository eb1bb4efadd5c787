// gtest matchers for absl::Status / absl::StatusOr (Debian's Abseil ships
// none).
//
//   EXPECT_THAT(index.Remove({"k"}, false)[0], StatusIs(absl::StatusCode::kNotFound));
//   ASSERT_OK(master.Flush());
//   ASSERT_OK_AND_ASSIGN(auto v, store.Get("k"));
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tierkv::testing {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <class T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

MATCHER(IsOk, "is OK") {
  const absl::Status& s = GetStatus(arg);
  if (!s.ok()) *result_listener << "status is " << s;
  return s.ok();
}

MATCHER_P(StatusIs, code, "has status code " + ::testing::PrintToString(absl::StatusCode(code))) {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status is " << s;
  return s.code() == code;
}

}  // namespace tierkv::testing

#define ASSERT_OK(expr) ASSERT_THAT((expr), ::tierkv::testing::IsOk())
#define EXPECT_OK(expr) EXPECT_THAT((expr), ::tierkv::testing::IsOk())
#define ASSERT_OK_AND_ASSIGN(lhs, rexpr)                       \
  auto TIERKV_TEST_CONCAT(statusor_, __LINE__) = (rexpr);      \
  ASSERT_OK(TIERKV_TEST_CONCAT(statusor_, __LINE__).status()); \
  lhs = std::move(TIERKV_TEST_CONCAT(statusor_, __LINE__)).value()
#define TIERKV_TEST_CONCAT_INNER(a, b) a##b
#define TIERKV_TEST_CONCAT(a, b) TIERKV_TEST_CONCAT_INNER(a, b)
