// `ferry proxy`: the disaggregation router in front of prefill and decode workers.
#pragma once

#include <CLI/CLI.hpp>

namespace ferry::cli {

void AddProxyCommand(CLI::App& app, int* rc);

}  // namespace ferry::cli
