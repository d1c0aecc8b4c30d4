// Names the calling thread as `top`, `ps -L` and profilers show it (Linux: at most 15 characters).
#pragma once

#if defined(__linux__)
#include <pthread.h>
#endif

namespace hytrain {

inline void name_this_thread(const char* name) {
#if defined(__linux__)
  (void)pthread_setname_np(pthread_self(), name);
#else
  (void)name;
#endif
}

}  // namespace hytrain
