// Minimal test harness: TEST(name) registers a function; CHECK records a failure with file and line
// and continues; the process exits non-zero if any check failed, so ctest reports it.
#pragma once

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace hytest {

struct Case {
  const char* name;
  std::function<void()> fn;
};

inline std::vector<Case>& cases() {
  static std::vector<Case> c;
  return c;
}
inline int& failures() {
  static int f = 0;
  return f;
}

struct Register {
  Register(const char* name, std::function<void()> fn) { cases().push_back({name, std::move(fn)}); }
};

inline int run_all() {
  for (auto& c : cases()) {
    const int before = failures();
    try {
      c.fn();
    } catch (const std::exception& e) {
      std::printf("  unexpected exception: %s\n", e.what());
      ++failures();
    }
    std::printf("[%s] %s\n", failures() == before ? " ok " : "FAIL", c.name);
  }
  std::printf("%d check(s) failed\n", failures());
  return failures() == 0 ? 0 : 1;
}

}  // namespace hytest

#define HYTEST_CAT2(a, b) a##b
#define HYTEST_CAT(a, b) HYTEST_CAT2(a, b)
#define TEST(name)                                                                   \
  static void name();                                                                \
  static ::hytest::Register HYTEST_CAT(reg_, name)(#name, name);                    \
  static void name()

#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::printf("  %s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond);         \
      ++::hytest::failures();                                                        \
    }                                                                                \
  } while (0)

#define CHECK_MSG(cond, ...)                                                         \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::printf("  %s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond);         \
      std::printf(__VA_ARGS__);                                                      \
      std::printf("\n");                                                             \
      ++::hytest::failures();                                                        \
    }                                                                                \
  } while (0)

#define CHECK_THROWS(expr)                                                           \
  do {                                                                               \
    bool thrown_ = false;                                                            \
    try {                                                                            \
      expr;                                                                          \
    } catch (const std::exception&) {                                                \
      thrown_ = true;                                                                \
    }                                                                                \
    CHECK_MSG(thrown_, "expected an exception from %s", #expr);                      \
  } while (0)

#define HYTEST_MAIN() \
  int main() { return ::hytest::run_all(); }
