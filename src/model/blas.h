// OpenBLAS, as the model's matrix products use it: its threads and its kernel set.
#pragma once

#include <string>

namespace ferry::model {

// The BLAS threads a model's matrix products use now (openblas_get_num_threads); Load sets
// them to the cores this process may use (its CPU affinity) divided among the TP ranks.
int BlasThreads();

// OpenBLAS's kernel set ("core"), as openblas_get_corename names it, after ChooseBlasCore.
std::string BlasCore();

// Makes OpenBLAS use kernels this CPU can run at full width. OpenBLAS picks its kernels by the
// CPU's family and model number, and a version older than the CPU (Debian 12's 0.3.21 on an
// Emerald Rapids Xeon, model 207) falls back to Prescott's SSE3 kernels: sgemm at a fifth of
// the SkylakeX kernels' rate. When OpenBLAS runs a pre-AVX2 core on a CPU with AVX2, this
// switches it, through OpenBLAS's own OPENBLAS_CORETYPE path, to the core its newer versions
// pick by feature: Cooperlake (AVX-512 BF16), SkylakeX (AVX-512), else Haswell (AVX2, FMA). An
// OPENBLAS_CORETYPE the user set is left alone, as is a build without DYNAMIC_ARCH; one that
// names a core narrower than the CPU (Haswell on an AVX-512 EPYC: sgemm at half the rate) is
// warned about once, on stderr and in the line returned. Idempotent and thread-safe;
// Model::Load calls it. Returns a line saying what it found and did.
const std::string& ChooseBlasCore();

}  // namespace ferry::model
