// `ferry discovery`: run the embedded store, or list the agents registered in a store.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace ferry::cli {

void AddDiscoveryCommand(CLI::App& app, int* rc);
// `ferry router-token`: prints the bearer token a router presents to the deployment's workers
// (e.g. OPENAI_API_KEY for vLLM's proxy in front of workers with a secret).
void AddRouterTokenCommand(CLI::App& app, int* rc);

// The deployment secret from --secret-file (trailing newlines dropped), or $FERRY_SECRET without
// one; CLI::ValidationError naming the flag for a file that cannot be read or is empty.
std::string LoadSecret(const std::string& file);

}  // namespace ferry::cli
