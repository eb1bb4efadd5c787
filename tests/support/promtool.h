// Whether Prometheus's own checker accepts a /metrics body: runs
// `promtool check metrics` (Debian package prometheus, which the test
// scripts install) on it. The failure message carries promtool's report.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "tests/support/process.h"

namespace tierkv::testing {

inline ::testing::AssertionResult PromtoolAccepts(const std::string& text) {
  if (std::system("command -v promtool >/dev/null 2>&1") != 0) {
    return ::testing::AssertionFailure() << "promtool is not installed (Debian package prometheus)";
  }
  const std::string path = MakeTempDir("tierkv-metrics") + "/metrics.txt";
  std::ofstream(path) << text;
  const int rc = std::system(("promtool check metrics < " + path + " > " + path + ".out 2>&1").c_str());
  std::ifstream out(path + ".out");
  std::string report((std::istreambuf_iterator<char>(out)), std::istreambuf_iterator<char>());
  if (rc != 0) return ::testing::AssertionFailure() << "promtool: " << report << "\n--- the text:\n" << text;
  return ::testing::AssertionSuccess();
}

}  // namespace tierkv::testing
