// `ferry bench serve`, `ferry bench plot` and `ferry demo`.
#pragma once

#include <CLI/CLI.hpp>

namespace ferry::cli {

void AddServeBenchCommands(CLI::App& bench, int* rc);
void AddDemoCommand(CLI::App& app, int* rc);

}  // namespace ferry::cli
