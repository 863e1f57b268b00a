#include "core/log.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace ferry {
namespace {

LogLevel LevelFromEnv() {
    const char* env = std::getenv("FERRY_LOG_LEVEL");
    if (env == nullptr) {
        return LogLevel::kWarn;
    }
    std::string_view v(env);
    if (v == "debug") return LogLevel::kDebug;
    if (v == "info") return LogLevel::kInfo;
    if (v == "error") return LogLevel::kError;
    if (v == "off") return LogLevel::kOff;
    return LogLevel::kWarn;
}

std::atomic<LogLevel>& Level() {
    static std::atomic<LogLevel> level{LevelFromEnv()};
    return level;
}

}  // namespace

std::string EscapeForLog(std::string_view text) {
    std::string out;
    out.reserve(text.size());
    for (unsigned char c : text) {
        if (c == '\\') {
            out += "\\\\";
        } else if (c >= 0x20 && c < 0x7f) {
            out += static_cast<char>(c);
        } else if (c == '\n') {
            out += "\\n";
        } else if (c == '\t') {
            out += "\\t";
        } else if (c == '\r') {
            out += "\\r";
        } else {
            static constexpr char kHex[] = "0123456789abcdef";
            out += "\\x";
            out += kHex[c >> 4];
            out += kHex[c & 15];
        }
    }
    return out;
}

LogLevel CurrentLogLevel() { return Level().load(std::memory_order_relaxed); }
void SetLogLevel(LogLevel level) { Level().store(level, std::memory_order_relaxed); }

void LogLine(LogLevel level, std::string_view text) {
    static constexpr const char* kNames[] = {"D", "I", "W", "E", "-"};
    auto now = std::chrono::system_clock::now().time_since_epoch();
    auto us = std::chrono::duration_cast<std::chrono::microseconds>(now).count();
    // One fwrite per line keeps lines from different threads whole. Messages carry what peers
    // and clients sent (names, paths, keys): escaped, so none can forge a line of its own.
    std::string line = fmt::format("{} {}.{:06d} ferry[{}] {}\n", kNames[static_cast<int>(level)],
                                   us / 1000000, us % 1000000, getpid(), EscapeForLog(text));
    std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace ferry
