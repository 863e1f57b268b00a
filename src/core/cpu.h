// How many cores this process may run on: its CPU affinity (`taskset`, cgroup cpusets), not the
// machine's core count. Every default sized "to the machine" uses this.
#pragma once

#include <sched.h>

#include <algorithm>
#include <thread>

namespace ferry {

// The CPUs in the calling thread's affinity mask (threads inherit the process's), at least 1.
inline int UsableCores() {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace ferry
