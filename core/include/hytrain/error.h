// Project-wide error type. Native code never calls exit() or abort() on bad input: it throws
// hytrain::Error carrying the failing call, file and line, and pybind11 turns it into a Python
// exception, so a mistake costs the user an exception, not the interpreter.
#pragma once

#include <stdexcept>
#include <string>

namespace hytrain {

class Error : public std::runtime_error {
 public:
  Error(const std::string& what, const char* file, int line)
      : std::runtime_error(what + " (" + file + ":" + std::to_string(line) + ")") {}
};

// Raised when the pinned host pool cannot satisfy a request within its capacity.
class PoolExhausted : public Error {
 public:
  using Error::Error;
};

// Raised when a host wait on device work passes its deadline.
class Timeout : public Error {
 public:
  using Error::Error;
};

}  // namespace hytrain

#define HYTRAIN_THROW(msg) throw ::hytrain::Error((msg), __FILE__, __LINE__)

#define HYTRAIN_CHECK(cond, msg)                                                   \
  do {                                                                             \
    if (!(cond)) throw ::hytrain::Error(std::string("check failed: " #cond ": ") + \
                                            (msg), __FILE__, __LINE__);            \
  } while (0)
