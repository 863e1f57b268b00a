// Minimal leveled logging to stderr. Level from FERRY_LOG_LEVEL (debug|info|warn|error|off),
// default warn so that libraries stay quiet; the CLI lowers it with --verbose.
#pragma once

#include <fmt/core.h>

#include <string>
#include <string_view>

namespace ferry {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3, kOff = 4 };

LogLevel CurrentLogLevel();
void SetLogLevel(LogLevel level);
// Writes one line: `text` with every byte outside printable ASCII (and the backslash) escaped
// (\n, \t, \r, \\, \xNN), so a line always stays one line.
void LogLine(LogLevel level, std::string_view text);
std::string EscapeForLog(std::string_view text);

}  // namespace ferry

#define FERRY_LOG(level, ...)                                                       \
    do {                                                                            \
        if (::ferry::LogLevel::level >= ::ferry::CurrentLogLevel()) {               \
            ::ferry::LogLine(::ferry::LogLevel::level, ::fmt::format(__VA_ARGS__)); \
        }                                                                           \
    } while (0)
