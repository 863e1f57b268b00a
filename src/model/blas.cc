#include "model/blas.h"

#include <cblas.h>
#include <fmt/core.h>
#include <strings.h>

#include <cstdlib>

#include "core/log.h"

// In OpenBLAS builds with DYNAMIC_ARCH (Debian's): drop and redo the choice of kernel table, as
// at load, which reads OPENBLAS_CORETYPE. Weak, so a build without them links and skips.
extern "C" void gotoblas_dynamic_init(void) __attribute__((weak));
extern "C" void gotoblas_dynamic_quit(void) __attribute__((weak));
extern "C" char* openblas_get_corename(void);

namespace ferry::model {

int BlasThreads() { return openblas_get_num_threads(); }

std::string BlasCore() {
    const char* name = openblas_get_corename();
    return name ? name : "";
}

namespace {

// How wide OpenBLAS's x86-64 kernels for a core name are: 0 older than AVX2, 1 AVX2 + FMA,
// 2 AVX-512; -1 a name not listed (left alone).
int BlasCoreWidth(const std::string& core) {
    static constexpr const char* kOld[] = {
        "Prescott",  "Core2",      "Penryn",       "Dunnington", "Nehalem", "Atom",
        "Nano",      "Opteron",    "Opteron_SSE3", "Barcelona",  "Bobcat",  "Sandybridge",
        "Bulldozer", "Piledriver", "Steamroller",  "Unknown"};
    static constexpr const char* kAvx2[] = {"Haswell", "Zen", "Excavator"};
    static constexpr const char* kAvx512[] = {"SkylakeX", "Cooperlake", "SapphireRapids"};
    auto in = [&](const auto& names) {
        for (const char* n : names) {
            if (strcasecmp(core.c_str(), n) == 0) return true;
        }
        return false;
    };
    if (in(kOld)) return 0;
    if (in(kAvx2)) return 1;
    if (in(kAvx512)) return 2;
    return -1;
}

}  // namespace

const std::string& ChooseBlasCore() {
    static const std::string said = [] {
        const std::string was = BlasCore();
        __builtin_cpu_init();
        const char* want = nullptr;
        int want_width = 0;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
            want = __builtin_cpu_supports("avx512bf16") ? "Cooperlake" : "SkylakeX";
            want_width = 2;
        } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
            want = "Haswell";
            want_width = 1;
        }
        const int width = BlasCoreWidth(was);
        if (std::getenv("OPENBLAS_CORETYPE")) {
            // Yours to choose; but a core narrower than the CPU halves sgemm (prefill) or worse,
            // and an environment can set it without anyone noticing: say so.
            if (want && width >= 0 && width < want_width) {
                std::string msg = fmt::format(
                    "OpenBLAS core {} (OPENBLAS_CORETYPE; this CPU has {}'s features: unset it "
                    "for wider sgemm kernels)",
                    was, want);
                FERRY_LOG(kWarn, "{}", msg);
                return msg;
            }
            return fmt::format("OpenBLAS core {} (OPENBLAS_CORETYPE)", was);
        }
        if (width != 0 || !want) return fmt::format("OpenBLAS core {}", was);
        if (!gotoblas_dynamic_init || !gotoblas_dynamic_quit) {
            return fmt::format(
                "OpenBLAS core {} on a CPU with {}'s features (OpenBLAS built "
                "without DYNAMIC_ARCH: left as is)",
                was, want);
        }
        // Before any BLAS call of ours. The variable is set only for OpenBLAS's init and then
        // removed, so child processes choose for themselves.
        setenv("OPENBLAS_CORETYPE", want, 1);
        gotoblas_dynamic_quit();
        gotoblas_dynamic_init();
        unsetenv("OPENBLAS_CORETYPE");
        return fmt::format(
            "OpenBLAS core {} (OpenBLAS picked {} for this CPU, which has {}'s "
            "features)",
            BlasCore(), was, want);
    }();
    return said;
}

}  // namespace ferry::model
