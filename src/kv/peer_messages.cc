#include "kv/peer_messages.h"

#include <fmt/core.h>

#include <nlohmann/json.hpp>

#include "core/json_depth.h"
#include "core/json_fields.h"

namespace ferry::kv::msg {

namespace {

using Json = nlohmann::json;

template <class... F>
struct Overloaded : F... {
    using F::operator()...;
};
template <class... F>
Overloaded(F...) -> Overloaded<F...>;

// --- encode ----------------------------------------------------------------------------------

Json CompatJson(const Compat& c) {
    return Json{{"protocol", c.protocol},   {"model", c.model},
                {"attention", c.attention}, {"layers", c.layers},
                {"kv_heads", c.kv_heads},   {"head_dim", c.head_dim},
                {"dtype", c.dtype},         {"block_tokens", c.block_tokens},
                {"layout", c.layout},       {"tp", c.tp}};
}

void PutFirst(Json& j, const FirstToken& f) {
    Json top = Json::array();
    for (auto [t, lp] : f.top) top.push_back({t, lp});
    j["token"] = f.token;
    j["logprob"] = f.logprob;
    j["top"] = std::move(top);
}

Json VerifyJson(const VerifyRequest& v) {
    return Json{{"begin", v.begin}, {"end", v.end}, {"units", v.units}};
}

// Checksums as 16 hex digits each (a JSON number would lose bits in most parsers).
Json SumsJson(const std::vector<uint64_t>& sums) {
    Json a = Json::array();
    for (uint64_t s : sums) a.push_back(fmt::format("{:016x}", s));
    return a;
}

Json EncodeJson(const Hello& m) {
    Json ranks = Json::array();
    for (const RankInfo& r : m.ranks) {
        Json ri{{"region", r.region}, {"blocks", r.blocks}};
        if (r.canary) ri["canary"] = r.canary;
        ranks.push_back(std::move(ri));
    }
    Json j{{"t", m.ack ? "hello-ack" : "hello"},
           {"v", m.version},
           {"compat", CompatJson(m.compat)},
           {"ranks", std::move(ranks)},
           {"addr", m.addr}};
    if (m.ack) {
        j["ok"] = m.ok;
        if (!m.ok) j["error"] = m.error;
    }
    return j;
}
Json EncodeJson(const Claim& m) {
    Json j{{"t", "claim"}, {"rid", m.rid},       {"nonce", m.nonce},
           {"lid", m.lid}, {"prompt", m.prompt}, {"blocks", m.blocks}};
    if (m.verify) j["verify"] = VerifyJson(*m.verify);
    return j;
}
Json EncodeJson(const ClaimAck& m) {
    Json j{{"t", "claim-ack"}, {"lid", m.lid}, {"ok", m.ok}};
    if (m.ok && m.first) PutFirst(j, *m.first);
    if (m.ok && !m.sums.empty()) j["sums"] = SumsJson(m.sums);
    if (!m.ok) {
        j["error"] = m.error;
        if (!m.code.empty()) j["code"] = m.code;
    }
    return j;
}
Json EncodeJson(const HoldEnd& m) {
    return Json{{"t", m.kind == HoldEnd::Kind::kReadDone ? "read-done" : "release"},
                {"rid", m.rid},
                {"nonce", m.nonce}};
}
Json EncodeJson(const HoldRenew& m) {
    return Json{{"t", "hold-renew"}, {"rid", m.rid}, {"nonce", m.nonce}, {"lease_ms", m.lease_ms}};
}
Json EncodeJson(const PushTarget& m) {
    Json j{{"t", "push-target"}, {"xid", m.xid}, {"lid", m.lid},      {"blocks", m.blocks},
           {"from", m.from},     {"len", m.len}, {"prompt", m.prompt}};
    if (m.verify) j["verify"] = VerifyJson(*m.verify);
    return j;
}
Json EncodeJson(const PushAlive& m) {
    return Json{{"t", "push-alive"}, {"xid", m.xid}, {"lid", m.lid}, {"lease_ms", m.lease_ms}};
}
Json EncodeJson(const PushCancel& m) {
    return Json{{"t", "push-cancel"}, {"xid", m.xid}, {"lid", m.lid}};
}
Json EncodeJson(const PushEnd& m) {
    const char* t = m.kind == PushEnd::Kind::kDone     ? "push-done"
                    : m.kind == PushEnd::Kind::kFailed ? "push-failed"
                                                       : "push-cancelled";
    Json j{{"t", t}, {"xid", m.xid}, {"lid", m.lid}};
    if (m.kind == PushEnd::Kind::kDone && m.first) PutFirst(j, *m.first);
    if (m.kind == PushEnd::Kind::kDone && !m.sums.empty()) j["sums"] = SumsJson(m.sums);
    if (m.kind == PushEnd::Kind::kFailed) j["error"] = m.error;
    return j;
}

// --- decode ----------------------------------------------------------------------------------

Result<int> SmallInt(const JsonFields& f, std::string_view key, int lo, int hi) {
    FERRY_ASSIGN_OR_RETURN(int64_t v, f.Int(key, lo, hi));
    return static_cast<int>(v);
}

Result<Compat> DecodeCompat(const JsonFields& f) {
    Compat c;
    FERRY_ASSIGN_OR_RETURN(c.protocol, SmallInt(f, "protocol", 0, INT32_MAX));
    FERRY_ASSIGN_OR_RETURN(c.model, f.String("model", kMaxIdChars));
    if (f.Has("attention")) {
        FERRY_ASSIGN_OR_RETURN(c.attention, f.String("attention", 16));
    }
    FERRY_ASSIGN_OR_RETURN(c.layers, SmallInt(f, "layers", 0, INT32_MAX));
    FERRY_ASSIGN_OR_RETURN(c.kv_heads, SmallInt(f, "kv_heads", 0, INT32_MAX));
    FERRY_ASSIGN_OR_RETURN(c.head_dim, SmallInt(f, "head_dim", 0, INT32_MAX));
    FERRY_ASSIGN_OR_RETURN(c.dtype, f.String("dtype", 64));
    FERRY_ASSIGN_OR_RETURN(c.block_tokens, SmallInt(f, "block_tokens", 0, INT32_MAX));
    FERRY_ASSIGN_OR_RETURN(c.layout, f.String("layout", 64));
    FERRY_ASSIGN_OR_RETURN(c.tp, SmallInt(f, "tp", 0, INT32_MAX));
    return c;
}

Result<FirstToken> DecodeFirst(const JsonFields& f) {
    FirstToken ft;
    FERRY_ASSIGN_OR_RETURN(ft.token, SmallInt(f, "token", 0, INT32_MAX));
    FERRY_ASSIGN_OR_RETURN(double lp, f.Number("logprob"));
    ft.logprob = static_cast<float>(lp);
    if (f.Has("top")) {
        FERRY_ASSIGN_OR_RETURN(const Json* top, f.Array("top", kMaxTopLogprobs));
        for (const Json& e : *top) {
            if (!e.is_array() || e.size() != 2 || !e[0].is_number_integer() || !e[1].is_number() ||
                e[0].get<int64_t>() < 0 || e[0].get<int64_t>() > INT32_MAX) {
                return f.Bad("top", "holds an entry that is not [token id, logprob]");
            }
            ft.top.emplace_back(static_cast<int32_t>(e[0].get<int64_t>()), e[1].get<float>());
        }
    }
    return ft;
}

Result<std::vector<BlockId>> DecodeBlocks(const JsonFields& f) {
    return f.IntArray<BlockId>("blocks", 0, INT32_MAX, kMaxBlocks);
}

Result<std::optional<VerifyRequest>> DecodeVerify(const JsonFields& f) {
    if (!f.Has("verify")) return std::optional<VerifyRequest>();
    FERRY_ASSIGN_OR_RETURN(JsonFields v, f.Object("verify"));
    VerifyRequest r;
    FERRY_ASSIGN_OR_RETURN(r.begin, SmallInt(v, "begin", 0, INT32_MAX));
    FERRY_ASSIGN_OR_RETURN(r.end, SmallInt(v, "end", 0, INT32_MAX));
    FERRY_ASSIGN_OR_RETURN(r.units, v.IntArray<int>("units", 0, INT32_MAX, kMaxUnits));
    if (r.end <= r.begin) return v.Bad("end", "is not after begin");
    return std::optional<VerifyRequest>(std::move(r));
}

Result<std::vector<uint64_t>> DecodeSums(const JsonFields& f) {
    std::vector<uint64_t> out;
    if (!f.Has("sums")) return out;
    FERRY_ASSIGN_OR_RETURN(const Json* a, f.Array("sums", kMaxUnits));
    for (const Json& e : *a) {
        const std::string* s = e.is_string() ? e.get_ptr<const std::string*>() : nullptr;
        if (!s || s->size() != 16 ||
            s->find_first_not_of("0123456789abcdef") != std::string::npos) {
            return f.Bad("sums", "holds an entry that is not 16 lowercase hex digits");
        }
        out.push_back(std::stoull(*s, nullptr, 16));
    }
    return out;
}

Result<PeerMessage> DecodeHello(const JsonFields& f, bool ack) {
    Hello m;
    m.ack = ack;
    FERRY_ASSIGN_OR_RETURN(m.version, SmallInt(f, "v", 0, INT32_MAX));
    FERRY_ASSIGN_OR_RETURN(JsonFields compat, f.Object("compat"));
    FERRY_ASSIGN_OR_RETURN(m.compat, DecodeCompat(compat));
    FERRY_ASSIGN_OR_RETURN(const Json* ranks, f.Array("ranks", kMaxRanks));
    for (size_t i = 0; i < ranks->size(); ++i) {
        JsonFields r((*ranks)[i], fmt::format("ranks[{}]", i));
        RankInfo ri;
        FERRY_ASSIGN_OR_RETURN(ri.region, r.Uint("region"));
        FERRY_ASSIGN_OR_RETURN(ri.blocks, SmallInt(r, "blocks", 1, 1 << 24));
        if (r.Has("canary")) {
            FERRY_ASSIGN_OR_RETURN(ri.canary, r.Uint("canary"));
        }
        m.ranks.push_back(ri);
    }
    FERRY_ASSIGN_OR_RETURN(m.addr, f.String("addr", kMaxIdChars));
    if (ack) {
        FERRY_ASSIGN_OR_RETURN(m.ok, f.Bool("ok"));
        if (!m.ok && f.Has("error")) {
            FERRY_ASSIGN_OR_RETURN(m.error, f.String("error", kMaxErrorChars));
        }
    }
    return PeerMessage(std::move(m));
}

Result<PeerMessage> DecodeClaim(const JsonFields& f) {
    Claim m;
    FERRY_ASSIGN_OR_RETURN(m.rid, f.String("rid", kMaxIdChars));
    FERRY_ASSIGN_OR_RETURN(m.nonce, f.Hex("nonce", 32));
    FERRY_ASSIGN_OR_RETURN(m.lid, f.String("lid", kMaxIdChars));
    FERRY_ASSIGN_OR_RETURN(m.prompt, f.Hex("prompt", 64));
    FERRY_ASSIGN_OR_RETURN(m.blocks, DecodeBlocks(f));
    FERRY_ASSIGN_OR_RETURN(m.verify, DecodeVerify(f));
    return PeerMessage(std::move(m));
}

Result<PeerMessage> DecodeClaimAck(const JsonFields& f) {
    ClaimAck m;
    FERRY_ASSIGN_OR_RETURN(m.lid, f.String("lid", kMaxIdChars));
    FERRY_ASSIGN_OR_RETURN(m.ok, f.Bool("ok"));
    if (m.ok) {
        FERRY_ASSIGN_OR_RETURN(m.first, DecodeFirst(f));
        FERRY_ASSIGN_OR_RETURN(m.sums, DecodeSums(f));
    } else {
        if (f.Has("error")) {
            FERRY_ASSIGN_OR_RETURN(m.error, f.String("error", kMaxErrorChars));
        }
        if (f.Has("code")) {
            FERRY_ASSIGN_OR_RETURN(m.code, f.String("code", 64));
        }
    }
    return PeerMessage(std::move(m));
}

Result<PeerMessage> DecodeHoldEnd(const JsonFields& f, HoldEnd::Kind kind) {
    HoldEnd m;
    m.kind = kind;
    FERRY_ASSIGN_OR_RETURN(m.rid, f.String("rid", kMaxIdChars));
    FERRY_ASSIGN_OR_RETURN(m.nonce, f.Hex("nonce", 32));
    return PeerMessage(std::move(m));
}

Result<PeerMessage> DecodeHoldRenew(const JsonFields& f) {
    HoldRenew m;
    FERRY_ASSIGN_OR_RETURN(m.rid, f.String("rid", kMaxIdChars));
    FERRY_ASSIGN_OR_RETURN(m.nonce, f.Hex("nonce", 32));
    FERRY_ASSIGN_OR_RETURN(m.lease_ms, SmallInt(f, "lease_ms", 1, 600000));
    return PeerMessage(std::move(m));
}

Result<PeerMessage> DecodePushTarget(const JsonFields& f) {
    PushTarget m;
    FERRY_ASSIGN_OR_RETURN(m.xid, f.String("xid", kMaxIdChars));
    FERRY_ASSIGN_OR_RETURN(m.lid, f.String("lid", kMaxIdChars));
    FERRY_ASSIGN_OR_RETURN(m.blocks, DecodeBlocks(f));
    FERRY_ASSIGN_OR_RETURN(m.from, SmallInt(f, "from", 0, INT32_MAX));
    FERRY_ASSIGN_OR_RETURN(m.len, SmallInt(f, "len", 1, INT32_MAX));
    FERRY_ASSIGN_OR_RETURN(m.prompt, f.Hex("prompt", 64));
    FERRY_ASSIGN_OR_RETURN(m.verify, DecodeVerify(f));
    return PeerMessage(std::move(m));
}

Result<PeerMessage> DecodePushAlive(const JsonFields& f) {
    PushAlive m;
    FERRY_ASSIGN_OR_RETURN(m.xid, f.String("xid", kMaxIdChars));
    FERRY_ASSIGN_OR_RETURN(m.lid, f.String("lid", kMaxIdChars));
    FERRY_ASSIGN_OR_RETURN(m.lease_ms, SmallInt(f, "lease_ms", 1, 600000));
    return PeerMessage(std::move(m));
}

Result<PeerMessage> DecodePushCancel(const JsonFields& f) {
    PushCancel m;
    FERRY_ASSIGN_OR_RETURN(m.xid, f.String("xid", kMaxIdChars));
    FERRY_ASSIGN_OR_RETURN(m.lid, f.String("lid", kMaxIdChars));
    return PeerMessage(std::move(m));
}

Result<PeerMessage> DecodePushEnd(const JsonFields& f, PushEnd::Kind kind) {
    PushEnd m;
    m.kind = kind;
    FERRY_ASSIGN_OR_RETURN(m.xid, f.String("xid", kMaxIdChars));
    FERRY_ASSIGN_OR_RETURN(m.lid, f.String("lid", kMaxIdChars));
    if (kind == PushEnd::Kind::kDone) {
        FERRY_ASSIGN_OR_RETURN(m.first, DecodeFirst(f));
        FERRY_ASSIGN_OR_RETURN(m.sums, DecodeSums(f));
    } else if (kind == PushEnd::Kind::kFailed && f.Has("error")) {
        FERRY_ASSIGN_OR_RETURN(m.error, f.String("error", kMaxErrorChars));
    }
    return PeerMessage(std::move(m));
}

}  // namespace

std::optional<CompatDiff> FirstDifference(const Compat& ours, const Compat& theirs) {
    auto num = [](int v) { return std::to_string(v); };
    const std::pair<const char*, std::pair<std::string, std::string>> fields[] = {
        {"protocol", {num(ours.protocol), num(theirs.protocol)}},
        {"attention", {ours.attention, theirs.attention}},
        {"model", {ours.model, theirs.model}},
        {"layers", {num(ours.layers), num(theirs.layers)}},
        {"kv_heads", {num(ours.kv_heads), num(theirs.kv_heads)}},
        {"head_dim", {num(ours.head_dim), num(theirs.head_dim)}},
        {"dtype", {ours.dtype, theirs.dtype}},
        {"layout", {ours.layout, theirs.layout}},
    };
    for (const auto& [name, v] : fields) {
        if (v.first != v.second) return CompatDiff{name, v.first, v.second};
    }
    return std::nullopt;
}

std::string_view TypeOf(const PeerMessage& m) {
    return std::visit(
        Overloaded{
            [](const Hello& h) -> std::string_view { return h.ack ? "hello-ack" : "hello"; },
            [](const Claim&) -> std::string_view { return "claim"; },
            [](const ClaimAck&) -> std::string_view { return "claim-ack"; },
            [](const HoldEnd& h) -> std::string_view {
                return h.kind == HoldEnd::Kind::kReadDone ? "read-done" : "release";
            },
            [](const HoldRenew&) -> std::string_view { return "hold-renew"; },
            [](const PushTarget&) -> std::string_view { return "push-target"; },
            [](const PushAlive&) -> std::string_view { return "push-alive"; },
            [](const PushCancel&) -> std::string_view { return "push-cancel"; },
            [](const PushEnd& p) -> std::string_view {
                return p.kind == PushEnd::Kind::kDone     ? "push-done"
                       : p.kind == PushEnd::Kind::kFailed ? "push-failed"
                                                          : "push-cancelled";
            },
        },
        m);
}

std::string Encode(const PeerMessage& m) {
    Json j = std::visit([](const auto& x) { return EncodeJson(x); }, m);
    // Peers' strings (errors) may hold invalid UTF-8: replaced, never thrown on.
    return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

Result<PeerMessage> Decode(std::string_view payload, std::string* type) {
    if (!JsonDepthWithin(payload, kMaxDepth)) {
        return InvalidArgumentError(fmt::format("a kv message nests deeper than {}", kMaxDepth));
    }
    Json j = Json::parse(payload, nullptr, false);
    if (j.is_discarded()) return InvalidArgumentError("a kv message is not JSON");
    JsonFields f(j);
    FERRY_ASSIGN_OR_RETURN(std::string t, f.String("t", 64));
    if (type) *type = t;
    Result<PeerMessage> m = InvalidArgumentError("");
    if (t == "hello" || t == "hello-ack") {
        m = DecodeHello(f, t == "hello-ack");
    } else if (t == "claim") {
        m = DecodeClaim(f);
    } else if (t == "claim-ack") {
        m = DecodeClaimAck(f);
    } else if (t == "read-done") {
        m = DecodeHoldEnd(f, HoldEnd::Kind::kReadDone);
    } else if (t == "release") {
        m = DecodeHoldEnd(f, HoldEnd::Kind::kRelease);
    } else if (t == "hold-renew") {
        m = DecodeHoldRenew(f);
    } else if (t == "push-target") {
        m = DecodePushTarget(f);
    } else if (t == "push-alive") {
        m = DecodePushAlive(f);
    } else if (t == "push-cancel") {
        m = DecodePushCancel(f);
    } else if (t == "push-done") {
        m = DecodePushEnd(f, PushEnd::Kind::kDone);
    } else if (t == "push-failed") {
        m = DecodePushEnd(f, PushEnd::Kind::kFailed);
    } else if (t == "push-cancelled") {
        m = DecodePushEnd(f, PushEnd::Kind::kCancelled);
    } else {
        std::string shown;
        for (char c : t) shown += (c >= 0x20 && c < 0x7f) ? c : '?';
        return InvalidArgumentError(fmt::format("unknown kv message type '{}'", shown));
    }
    return m;
}

}  // namespace ferry::kv::msg
