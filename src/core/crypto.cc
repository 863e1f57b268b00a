#include "core/crypto.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace ferry {

void SecureRandom(void* out, size_t n) {
    auto* p = static_cast<uint8_t*>(out);
    while (n > 0) {
        ssize_t r = getrandom(p, n, 0);
        if (r < 0) {
            if (errno == EINTR) {
                continue;
            }
            std::perror("ferry: getrandom");
            std::abort();
        }
        p += r;
        n -= static_cast<size_t>(r);
    }
}

uint64_t SecureRandomU64() {
    uint64_t v = 0;
    SecureRandom(&v, sizeof(v));
    return v;
}

Nonce RandomNonce() {
    Nonce n;
    SecureRandom(n.data(), n.size());
    return n;
}

Digest HmacSha256(std::string_view key, std::string_view data) {
    Digest out{};
    unsigned int len = 0;
    HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
         reinterpret_cast<const unsigned char*>(data.data()), data.size(), out.data(), &len);
    return out;
}

Digest Sha256(std::string_view data) {
    Digest out{};
    unsigned int len = 0;
    EVP_Digest(data.data(), data.size(), out.data(), &len, EVP_sha256(), nullptr);
    return out;
}

std::string RandomId128() {
    uint8_t b[16];
    SecureRandom(b, sizeof(b));
    return HexEncode(b, sizeof(b));
}

bool SecretEqual(std::string_view a, std::string_view b) {
    return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string RouterToken(std::string_view secret) {
    if (secret.empty()) return "";
    Digest d = HmacSha256(secret, "ferry/router-token/v1");
    return "ferry-rt1-" + HexEncode(d.data(), d.size());
}

bool DigestEqual(const Digest& a, const Digest& b) {
    return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string HexEncode(const uint8_t* p, size_t n) {
    static constexpr char kHex[] = "0123456789abcdef";
    std::string out(2 * n, '0');
    for (size_t i = 0; i < n; ++i) {
        out[2 * i] = kHex[p[i] >> 4];
        out[2 * i + 1] = kHex[p[i] & 15];
    }
    return out;
}

bool HexDecode(std::string_view hex, std::string* out) {
    if (hex.size() % 2 != 0) return false;
    auto val = [](char c) -> int {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        return -1;
    };
    out->clear();
    out->reserve(hex.size() / 2);
    for (size_t i = 0; i < hex.size(); i += 2) {
        int hi = val(hex[i]), lo = val(hex[i + 1]);
        if (hi < 0 || lo < 0) return false;
        out->push_back(static_cast<char>(hi * 16 + lo));
    }
    return true;
}

Result<std::string> LoadDeploymentSecret(const std::string& file) {
    if (file.empty()) {
        const char* env = std::getenv("FERRY_SECRET");
        return std::string(env != nullptr ? env : "");
    }
    std::ifstream in(file);
    if (!in) return InvalidArgumentError("--secret-file: cannot read '" + file + "'");
    std::stringstream ss;
    ss << in.rdbuf();
    std::string s = ss.str();
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    if (s.empty()) return InvalidArgumentError("--secret-file: '" + file + "' is empty");
    return s;
}

}  // namespace ferry
