// Randomness and message authentication for region keys, epochs and the deployment secret.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "ferry/status.h"

namespace ferry {

using Digest = std::array<uint8_t, 32>;
using Nonce = std::array<uint8_t, 32>;

// Cryptographically secure random bytes (getrandom); aborts only if the kernel cannot supply them.
void SecureRandom(void* out, size_t n);
uint64_t SecureRandomU64();
Nonce RandomNonce();

// HMAC-SHA256(key, data).
Digest HmacSha256(std::string_view key, std::string_view data);
// SHA-256(data).
Digest Sha256(std::string_view data);

// 128 random bits as 32 lower-case hex characters: ids and nonces that must not be guessed.
std::string RandomId128();

// Constant-time equality of two strings (lengths may leak, contents do not).
bool SecretEqual(std::string_view a, std::string_view b);

// The bearer token a deployment's router presents to its workers ("Authorization: Bearer ..."),
// derived from the deployment secret: HMAC-SHA256(secret, "ferry/router-token/v1") in hex,
// prefixed "ferry-rt1-". Empty for an empty secret.
std::string RouterToken(std::string_view secret);

// The deployment secret: the file's contents without trailing newlines, or $FERRY_SECRET when
// `file` is empty ("" when neither is set). Never a command-line value, which `ps` shows.
// InvalidArgument naming the file when it cannot be read or is empty.
Result<std::string> LoadDeploymentSecret(const std::string& file);

// Lower-case hexadecimal of `n` bytes.
std::string HexEncode(const uint8_t* p, size_t n);
// The bytes of lower-case hexadecimal `hex` into `out`; false for an odd length or any other
// character.
bool HexDecode(std::string_view hex, std::string* out);

// Constant-time comparison, so a wrong proof leaks nothing through timing.
bool DigestEqual(const Digest& a, const Digest& b);

}  // namespace ferry
