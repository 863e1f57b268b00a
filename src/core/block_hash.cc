#include "core/block_hash.h"

#include <cstring>

namespace ferry {

namespace {

// A CBOR head: major type and argument in the shortest form (RFC 8949 §4.2.1, canonical).
void AppendHead(std::string* out, uint8_t major, uint64_t v) {
    const uint8_t m = static_cast<uint8_t>(major << 5);
    auto be = [&](int bytes) {
        for (int i = bytes - 1; i >= 0; --i)
            out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    };
    if (v < 24) {
        out->push_back(static_cast<char>(m | v));
    } else if (v <= 0xff) {
        out->push_back(static_cast<char>(m | 24));
        be(1);
    } else if (v <= 0xffff) {
        out->push_back(static_cast<char>(m | 25));
        be(2);
    } else if (v <= 0xffffffffull) {
        out->push_back(static_cast<char>(m | 26));
        be(4);
    } else {
        out->push_back(static_cast<char>(m | 27));
        be(8);
    }
}

void AppendInt(std::string* out, int64_t v) {
    if (v >= 0) {
        AppendHead(out, 0, static_cast<uint64_t>(v));
    } else {
        AppendHead(out, 1, static_cast<uint64_t>(-(v + 1)));
    }
}

}  // namespace

BlockHash RootBlockHash(std::string_view seed) {
    std::string cbor;
    AppendHead(&cbor, 3, seed.size());  // text string
    cbor.append(seed);
    return Sha256(cbor);
}

std::vector<std::string_view> MmExtraKeys(std::span<const MmSpan> mm, int64_t start, int64_t end) {
    std::vector<std::string_view> out;
    for (const MmSpan& m : mm) {
        if (m.offset >= end) break;
        if (m.offset + m.length > start) out.push_back(m.hash);
    }
    return out;
}

BlockHash HashBlockTokens(const BlockHash& parent, std::span<const int32_t> tokens,
                          std::span<const std::string_view> extra_keys) {
    std::string cbor;
    cbor.reserve(40 + tokens.size() * 3);
    AppendHead(&cbor, 4, 3);  // [parent, tokens, extra keys]
    AppendHead(&cbor, 2, parent.size());
    cbor.append(reinterpret_cast<const char*>(parent.data()), parent.size());
    AppendHead(&cbor, 4, tokens.size());
    for (int32_t t : tokens) AppendInt(&cbor, t);
    if (extra_keys.empty()) {
        cbor.push_back(static_cast<char>(0xf6));  // null: no extra keys
    } else {
        AppendHead(&cbor, 4, extra_keys.size());
        for (std::string_view k : extra_keys) {
            AppendHead(&cbor, 3, k.size());  // text string
            cbor.append(k);
        }
    }
    return Sha256(cbor);
}

std::vector<BlockHash> HashFullBlocks(const BlockHash& root, std::span<const int32_t> tokens,
                                      int block_size, std::span<const MmSpan> mm) {
    std::vector<BlockHash> out;
    if (block_size <= 0) return out;
    const size_t bs = static_cast<size_t>(block_size);
    out.reserve(tokens.size() / bs);
    BlockHash parent = root;
    for (size_t i = 0; i + bs <= tokens.size(); i += bs) {
        const auto extra = MmExtraKeys(mm, static_cast<int64_t>(i), static_cast<int64_t>(i + bs));
        parent = HashBlockTokens(parent, tokens.subspan(i, bs), extra);
        out.push_back(parent);
    }
    return out;
}

uint64_t BlockHashToInt(const BlockHash& h) {
    uint64_t v = 0;
    for (size_t i = h.size() - 8; i < h.size(); ++i) v = (v << 8) | h[i];
    return v;
}

size_t BlockHashKey::operator()(const BlockHash& h) const {
    size_t v;
    std::memcpy(&v, h.data(), sizeof v);
    return v;
}

}  // namespace ferry
