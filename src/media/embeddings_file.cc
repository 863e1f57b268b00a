#include "media/embeddings_file.h"

#include <fcntl.h>
#include <fmt/core.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/crypto.h"

namespace ferry::media {

namespace {

using Json = nlohmann::json;

}  // namespace

bool IsMmHash(std::string_view s) {
    if (s.size() != 64) return false;
    for (char c : s) {
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
    }
    return true;
}

uint64_t EmbeddingsChecksum(const void* p, size_t n) { return XXH3_64bits(p, n); }

Result<uint64_t> WriteEmbeddingsFile(const std::string& path, const std::vector<float>& floats,
                                     size_t width, const FileMetadata& metadata, mode_t mode) {
    if (width == 0 || floats.empty() || floats.size() % width != 0) {
        return InvalidArgumentError(fmt::format("embeddings file {}: {} floats are not rows of {}",
                                                path, floats.size(), width));
    }
    const uint64_t bytes = floats.size() * sizeof(float);
    Json meta = Json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    meta["xxh3"] = fmt::format("{:016x}", EmbeddingsChecksum(floats.data(), bytes));
    const Json header = {{"__metadata__", meta},
                         {"ec_cache",
                          {{"dtype", "F32"},
                           {"shape", {floats.size() / width, width}},
                           {"data_offsets", {0, bytes}}}}};
    std::string h = header.dump();
    h.resize((h.size() + 7) / 8 * 8, ' ');  // the format pads its header with spaces to 8
    std::string out(8, '\0');
    const uint64_t hl = h.size();
    std::memcpy(out.data(), &hl, 8);  // little-endian u64
    out += h;
    out.append(reinterpret_cast<const char*>(floats.data()), bytes);
    const size_t slash = path.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
    const std::string tmp = fmt::format("{}/.tmp-{}-{}", dir, getpid(), RandomId128());
    const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    if (fd < 0) return InternalError(fmt::format("open {}: {}", tmp, std::strerror(errno)));
    size_t done = 0;
    while (done < out.size()) {
        const ssize_t n = write(fd, out.data() + done, out.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            const int err = n < 0 ? errno : ENOSPC;
            close(fd);
            unlink(tmp.c_str());
            return InternalError(fmt::format("write {}: {}", tmp, std::strerror(err)));
        }
        done += size_t(n);
    }
    if (close(fd) != 0) {
        const int err = errno;
        unlink(tmp.c_str());
        return InternalError(fmt::format("close {}: {}", tmp, std::strerror(err)));
    }
    if (rename(tmp.c_str(), path.c_str()) != 0) {
        const int err = errno;
        unlink(tmp.c_str());
        return InternalError(fmt::format("rename to {}: {}", path, std::strerror(err)));
    }
    return uint64_t(out.size());
}

Result<Embeddings> ReadEmbeddingsFile(const std::string& path, size_t floats, size_t width,
                                      FileMetadata* metadata) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT) return NotFoundError(fmt::format("no file {}", path));
        return UnavailableError(fmt::format("open {}: {}", path, std::strerror(errno)));
    }
    struct stat st {};
    std::string data;
    if (fstat(fd, &st) != 0) {
        const int err = errno;
        close(fd);
        return UnavailableError(fmt::format("stat {}: {}", path, std::strerror(err)));
    }
    const uint64_t most = 8 + kMaxEmbeddingsHeaderBytes + uint64_t(floats) * sizeof(float);
    if (!S_ISREG(st.st_mode) || uint64_t(st.st_size) > most) {
        close(fd);
        return DataLossError(
            fmt::format("{}: not a regular file of at most {} bytes (a header "
                        "and {} floats)",
                        path, most, floats));
    }
    data.resize(size_t(st.st_size));
    size_t done = 0;
    while (done < data.size()) {
        const ssize_t n = read(fd, data.data() + done, data.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            const int err = errno;
            close(fd);
            return UnavailableError(fmt::format("read {}: {}", path, std::strerror(err)));
        }
        if (n == 0) break;
        done += size_t(n);
    }
    data.resize(done);
    close(fd);
    return ParseEmbeddingsFile(data, path, floats, width, metadata);
}

Result<Embeddings> ParseEmbeddingsFile(std::string_view data, std::string_view name, size_t floats,
                                       size_t width, FileMetadata* metadata) {
    if (width == 0) width = 1;
    auto bad = [&](std::string_view what) {
        return DataLossError(fmt::format("{}: {}", name, what));
    };
    if (data.size() < 8) return bad("shorter than a safetensors header");
    uint64_t hl;
    std::memcpy(&hl, data.data(), 8);
    if (hl > data.size() - 8) return bad("its header length runs past the end");
    const Json h = Json::parse(data.substr(8, hl), nullptr, false);
    if (!h.is_object() || !h.contains("ec_cache") || !h["ec_cache"].is_object()) {
        return bad("no tensor \"ec_cache\"");
    }
    const Json& t = h["ec_cache"];
    const uint64_t bytes = uint64_t(floats) * sizeof(float);
    // Compared as JSON values: a field of another type is a mismatch (value() would throw).
    if (!t.contains("dtype") || t["dtype"] != Json("F32") || !t.contains("data_offsets") ||
        t["data_offsets"] != Json({0, bytes}) || !t.contains("shape") || !t["shape"].is_array() ||
        t["shape"].size() != 2 || t["shape"] != Json({floats / width, width})) {
        return bad(fmt::format("\"ec_cache\" is not F32 [{}, {}]", floats / width, width));
    }
    if (data.size() - 8 - hl != bytes) return bad("its data is not the tensor's size");
    FileMetadata meta;
    if (h.contains("__metadata__")) {
        if (!h["__metadata__"].is_object()) return bad("its __metadata__ is not an object");
        for (const auto& [k, v] : h["__metadata__"].items()) {
            if (!v.is_string()) return bad(fmt::format("metadata '{}' is not a string", k));
            meta[k] = v.get<std::string>();
        }
    }
    auto e = std::make_shared<std::vector<float>>(floats);
    if (bytes) std::memcpy(e->data(), data.data() + 8 + hl, bytes);
    if (auto x = meta.find("xxh3");
        x != meta.end() &&
        x->second != fmt::format("{:016x}", EmbeddingsChecksum(e->data(), bytes))) {
        return bad("its checksum does not match its data");
    }
    if (metadata) *metadata = std::move(meta);
    return Embeddings(std::move(e));
}

}  // namespace ferry::media
