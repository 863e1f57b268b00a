// `ferry model init|info`, `ferry serve` and `ferry bench model`: the inference engine's commands.
#pragma once

#include <CLI/CLI.hpp>

namespace ferry::cli {

void AddModelCommand(CLI::App& app, int* rc);
void AddServeCommand(CLI::App& app, int* rc);
void AddModelBenchCommand(CLI::App& bench, int* rc);

}  // namespace ferry::cli
