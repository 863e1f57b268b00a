#include "schema/kv_events.h"

#include <fmt/core.h>

#include <cstring>

#include "core/msgpack.h"

namespace ferry::schema {

// --- encoding (the worker's publisher) ----------------------------------------------------

namespace {

using Msgpack = MsgpackWriter;

void Hash(Msgpack& m, const BlockHash& h, KvEventsLayout layout) {
    if (layout == KvEventsLayout::kLegacy) {
        m.Uint(BlockHashToInt(h));
    } else {
        m.Bin(h.data(), h.size());
    }
}

void Hashes(Msgpack& m, const std::vector<BlockHash>& hs, KvEventsLayout layout) {
    m.Array(hs.size());
    for (const BlockHash& h : hs) Hash(m, h, layout);
}

void Event(Msgpack& m, const KvCacheEvent& e, KvEventsLayout layout, int block_size) {
    using Kind = KvCacheEvent::Kind;
    const bool legacy = layout == KvEventsLayout::kLegacy;
    auto key = [&](const char* k) {
        if (!legacy) m.Str(k);
    };
    switch (e.kind) {
        case Kind::kStored:
            legacy ? m.Array(7) : m.Map(9);
            key("type");
            m.Str("BlockStored");
            key("block_hashes");
            Hashes(m, e.hashes, layout);
            key("parent_block_hash");
            e.parent ? Hash(m, *e.parent, layout) : m.Nil();
            key("token_ids");
            m.Array(e.tokens.size());
            for (int32_t t : e.tokens) m.Int(t);
            key("block_size");
            m.Int(block_size);
            key("lora_id");
            m.Nil();
            key("medium");
            m.Str("GPU");
            if (!legacy) {
                m.Str("lora_name");
                m.Nil();
                m.Str("group_idx");
                m.Uint(0);
            }
            break;
        case Kind::kRemoved:
            legacy ? m.Array(3) : m.Map(4);
            key("type");
            m.Str("BlockRemoved");
            key("block_hashes");
            Hashes(m, e.hashes, layout);
            key("medium");
            m.Str("GPU");
            if (!legacy) {
                m.Str("group_idx");
                m.Uint(0);
            }
            break;
        case Kind::kAllCleared:
            legacy ? m.Array(1) : m.Map(1);
            key("type");
            m.Str("AllBlocksCleared");
            break;
    }
}

}  // namespace

Result<KvEventsLayout> ParseKvEventsLayout(std::string_view name) {
    if (name == "vllm") return KvEventsLayout::kVllm;
    if (name == "legacy") return KvEventsLayout::kLegacy;
    return InvalidArgumentError(
        fmt::format("kv events layout '{}' is not one of vllm, legacy", name));
}

std::string EncodeKvEventBatch(double ts, std::span<const KvCacheEvent> events,
                               KvEventsLayout layout, int block_size) {
    Msgpack m;
    const bool legacy = layout == KvEventsLayout::kLegacy;
    if (legacy) {
        m.Array(2);
    } else {
        m.Map(3);
        m.Str("ts");
    }
    m.Float(ts);
    if (!legacy) m.Str("events");
    m.Array(events.size());
    for (const KvCacheEvent& e : events) Event(m, e, layout, block_size);
    if (!legacy) {
        m.Str("data_parallel_rank");
        m.Uint(0);
    }
    return m.Take();
}

// --- framing and decoding (the router's follower) -------------------------------------------

namespace {

Result<std::vector<BlockHash>> ReadHashes(MsgpackReader& r) {
    FERRY_ASSIGN_OR_RETURN(size_t n, r.ReadArray());
    std::vector<BlockHash> out(n);
    for (size_t i = 0; i < n; ++i) {
        FERRY_ASSIGN_OR_RETURN(MsgpackReader::Type t, r.Peek());
        if (t != MsgpackReader::Type::kBin) {
            return InvalidArgumentError(
                "kv events: a block hash is not 32 bytes (the router reads layout vllm, not "
                "legacy's integers)");
        }
        FERRY_ASSIGN_OR_RETURN(std::string_view h, r.ReadBin());
        if (h.size() != out[i].size()) {
            return InvalidArgumentError(
                fmt::format("kv events: a block hash of {} bytes, not 32", h.size()));
        }
        std::memcpy(out[i].data(), h.data(), h.size());
    }
    return out;
}

Result<KvCacheEvent> ReadEvent(MsgpackReader& r, bool* known) {
    FERRY_ASSIGN_OR_RETURN(size_t pairs, r.ReadMap());
    KvCacheEvent e;
    std::string type;
    bool have_hashes = false;
    for (size_t i = 0; i < pairs; ++i) {
        FERRY_ASSIGN_OR_RETURN(std::string_view key, r.ReadStr());
        if (key == "type") {
            FERRY_ASSIGN_OR_RETURN(std::string_view t, r.ReadStr());
            type = std::string(t.substr(0, 64));
        } else if (key == "block_hashes") {
            FERRY_ASSIGN_OR_RETURN(e.hashes, ReadHashes(r));
            have_hashes = true;
        } else {
            FERRY_RETURN_IF_ERROR(r.Skip());
        }
    }
    *known = true;
    if (type == "BlockStored") {
        e.kind = KvCacheEvent::Kind::kStored;
    } else if (type == "BlockRemoved") {
        e.kind = KvCacheEvent::Kind::kRemoved;
    } else if (type == "AllBlocksCleared") {
        e.kind = KvCacheEvent::Kind::kAllCleared;
    } else if (type.empty()) {
        return InvalidArgumentError("kv events: an event without a 'type'");
    } else {
        *known = false;
        return e;
    }
    if (e.kind != KvCacheEvent::Kind::kAllCleared && !have_hashes) {
        return InvalidArgumentError(fmt::format("kv events: {} without 'block_hashes'", type));
    }
    return e;
}

}  // namespace

std::string KvEventSeqBytes(int64_t seq) {
    std::string s(8, '\0');
    for (int i = 0; i < 8; ++i) s[7 - i] = char((uint64_t(seq) >> (8 * i)) & 0xff);
    return s;
}

std::optional<int64_t> KvEventSeqOf(std::string_view frame) {
    if (frame.size() != 8) return std::nullopt;
    uint64_t v = 0;
    for (unsigned char c : frame) v = (v << 8) | c;
    return int64_t(v);
}

Result<std::vector<KvCacheEvent>> DecodeKvEventBatch(std::string_view payload, size_t* unknown) {
    MsgpackReader r(payload);
    FERRY_ASSIGN_OR_RETURN(MsgpackReader::Type top, r.Peek());
    if (top != MsgpackReader::Type::kMap) {
        return InvalidArgumentError(
            "kv events: the batch is not a map (the router reads layout vllm, not legacy)");
    }
    FERRY_ASSIGN_OR_RETURN(size_t pairs, r.ReadMap());
    std::vector<KvCacheEvent> out;
    bool have_events = false;
    for (size_t i = 0; i < pairs; ++i) {
        FERRY_ASSIGN_OR_RETURN(std::string_view key, r.ReadStr());
        if (key != "events") {
            FERRY_RETURN_IF_ERROR(r.Skip());
            continue;
        }
        have_events = true;
        FERRY_ASSIGN_OR_RETURN(size_t n, r.ReadArray());
        for (size_t k = 0; k < n; ++k) {
            bool known = true;
            FERRY_ASSIGN_OR_RETURN(KvCacheEvent e, ReadEvent(r, &known));
            if (known) {
                out.push_back(std::move(e));
            } else if (unknown) {
                ++*unknown;
            }
        }
    }
    if (!have_events) return InvalidArgumentError("kv events: the batch has no 'events'");
    if (!r.done()) {
        return InvalidArgumentError(
            fmt::format("kv events: {} bytes after the batch", payload.size() - r.position()));
    }
    return out;
}

}  // namespace ferry::schema
