// `ferry discovery`: run the embedded store, or list the agents registered in a store.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace ferry::cli {

void AddDiscoveryCommand(CLI::App& app, int* rc);

// The deployment secret from --secret-file (trailing newlines dropped), or $FERRY_SECRET without
// one; CLI::ValidationError naming the flag for a file that cannot be read or is empty.
std::string LoadSecret(const std::string& file);

}  // namespace ferry::cli
