// `ferry discovery`: run the embedded store, or list the agents registered in a store.
#pragma once

#include <CLI/CLI.hpp>

namespace ferry::cli {

void AddDiscoveryCommand(CLI::App& app, int* rc);

}  // namespace ferry::cli
