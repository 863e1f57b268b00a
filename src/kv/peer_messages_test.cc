#include "kv/peer_messages.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <set>

namespace ferry::kv::msg {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

const std::string kNonce(32, 'a');
const std::string kPrompt(64, '0');

FirstToken First() { return FirstToken{42, -0.5f, {{42, -0.5f}, {7, -1.25f}}}; }

Hello SomeHello(bool ack) {
    Hello h;
    h.ack = ack;
    h.compat.model = "fp";
    h.compat.layers = 12;
    h.compat.kv_heads = 4;
    h.compat.head_dim = 64;
    h.compat.dtype = "f32";
    h.compat.block_tokens = 16;
    h.compat.tp = 2;
    h.ranks = {{7, 100, 9}, {uint64_t{1} << 40, 200, uint64_t{1} << 41}};
    h.addr = "127.0.0.1:5000";
    if (ack) {
        h.ok = false;
        h.error = "no";
    }
    return h;
}

// One of every message, each field set to something other than its default.
std::vector<PeerMessage> Every() {
    return {
        SomeHello(false),
        SomeHello(true),
        Claim{"rid-1", kNonce, "lid-1", kPrompt, {0, 5, 2147483647}},
        Claim{"rid-1", kNonce, "lid-1", kPrompt, {0, 5}, VerifyRequest{3, 40, {0, 5, 7}}},
        ClaimAck{"lid-1", true, First(), "", ""},
        ClaimAck{"lid-1", true, First(), "", "", {0, UINT64_MAX, 0x0123456789abcdefULL}},
        ClaimAck{"lid-1", false, std::nullopt, "gone away", "gone"},
        HoldEnd{HoldEnd::Kind::kReadDone, "rid-1", kNonce},
        HoldEnd{HoldEnd::Kind::kRelease, "rid-1", kNonce},
        HoldRenew{"rid-1", kNonce, 3000},
        PushTarget{"x-1", "lid-1", {3, 4}, 16, 40, kPrompt},
        PushTarget{"x-1", "lid-1", {3, 4}, 16, 40, kPrompt, VerifyRequest{16, 40, {1}}},
        PushAlive{"x-1", "lid-1", 3000},
        PushCancel{"x-1", "lid-1"},
        PushEnd{PushEnd::Kind::kDone, "x-1", "lid-1", First(), ""},
        PushEnd{PushEnd::Kind::kDone, "x-1", "lid-1", First(), "", {42, 1}},
        PushEnd{PushEnd::Kind::kFailed, "x-1", "lid-1", std::nullopt, "out of blocks"},
        PushEnd{PushEnd::Kind::kCancelled, "x-1", "lid-1", std::nullopt, ""},
    };
}

bool SameFirst(const std::optional<FirstToken>& a, const std::optional<FirstToken>& b) {
    if (a.has_value() != b.has_value()) return false;
    return !a || (a->token == b->token && a->logprob == b->logprob && a->top == b->top);
}

bool SameVerify(const std::optional<VerifyRequest>& a, const std::optional<VerifyRequest>& b) {
    if (a.has_value() != b.has_value()) return false;
    return !a || (a->begin == b->begin && a->end == b->end && a->units == b->units);
}

bool Same(const PeerMessage& a, const PeerMessage& b) {
    if (a.index() != b.index() || TypeOf(a) != TypeOf(b)) return false;
    if (auto* x = std::get_if<Hello>(&a)) {
        auto& y = std::get<Hello>(b);
        if (x->ranks.size() != y.ranks.size()) return false;
        for (size_t i = 0; i < x->ranks.size(); ++i) {
            if (x->ranks[i].region != y.ranks[i].region ||
                x->ranks[i].blocks != y.ranks[i].blocks || x->ranks[i].canary != y.ranks[i].canary)
                return false;
        }
        return x->ack == y.ack && x->version == y.version &&
               !FirstDifference(x->compat, y.compat) && x->compat.tp == y.compat.tp &&
               x->compat.block_tokens == y.compat.block_tokens && x->addr == y.addr &&
               x->ok == y.ok && x->error == y.error;
    }
    if (auto* x = std::get_if<Claim>(&a)) {
        auto& y = std::get<Claim>(b);
        return x->rid == y.rid && x->nonce == y.nonce && x->lid == y.lid && x->prompt == y.prompt &&
               x->blocks == y.blocks && SameVerify(x->verify, y.verify);
    }
    if (auto* x = std::get_if<ClaimAck>(&a)) {
        auto& y = std::get<ClaimAck>(b);
        return x->lid == y.lid && x->ok == y.ok && SameFirst(x->first, y.first) &&
               x->error == y.error && x->code == y.code && x->sums == y.sums;
    }
    if (auto* x = std::get_if<HoldEnd>(&a)) {
        auto& y = std::get<HoldEnd>(b);
        return x->kind == y.kind && x->rid == y.rid && x->nonce == y.nonce;
    }
    if (auto* x = std::get_if<HoldRenew>(&a)) {
        auto& y = std::get<HoldRenew>(b);
        return x->rid == y.rid && x->nonce == y.nonce && x->lease_ms == y.lease_ms;
    }
    if (auto* x = std::get_if<PushAlive>(&a)) {
        auto& y = std::get<PushAlive>(b);
        return x->xid == y.xid && x->lid == y.lid && x->lease_ms == y.lease_ms;
    }
    if (auto* x = std::get_if<PushTarget>(&a)) {
        auto& y = std::get<PushTarget>(b);
        return x->xid == y.xid && x->lid == y.lid && x->blocks == y.blocks && x->from == y.from &&
               x->len == y.len && x->prompt == y.prompt && SameVerify(x->verify, y.verify);
    }
    if (auto* x = std::get_if<PushCancel>(&a)) {
        auto& y = std::get<PushCancel>(b);
        return x->xid == y.xid && x->lid == y.lid;
    }
    auto& x = std::get<PushEnd>(a);
    auto& y = std::get<PushEnd>(b);
    return x.kind == y.kind && x.xid == y.xid && x.lid == y.lid && SameFirst(x.first, y.first) &&
           x.error == y.error && x.sums == y.sums;
}

TEST(PeerMessages, EveryMessageRoundTrips) {
    for (const PeerMessage& m : Every()) {
        std::string wire = Encode(m);
        std::string type;
        auto back = Decode(wire, &type);
        ASSERT_TRUE(back.ok()) << wire << ": " << back.status().ToString();
        EXPECT_EQ(type, TypeOf(m));
        EXPECT_TRUE(Same(m, *back)) << wire;
        EXPECT_EQ(Encode(*back), wire);
    }
}

TEST(PeerMessages, EveryTruncationIsRefused) {
    for (const PeerMessage& m : Every()) {
        std::string wire = Encode(m);
        for (size_t n = 0; n < wire.size(); ++n) {
            auto r = Decode(std::string_view(wire).substr(0, n));
            EXPECT_FALSE(r.ok()) << "a prefix of " << n << " bytes of " << wire << " decoded";
        }
    }
}

TEST(PeerMessages, UnknownFieldsAreIgnored) {
    for (const PeerMessage& m : Every()) {
        Json j = Json::parse(Encode(m));
        j["from_a_newer_peer"] = {{"x", 1}};
        auto back = Decode(j.dump());
        ASSERT_TRUE(back.ok()) << j.dump() << ": " << back.status().ToString();
        EXPECT_TRUE(Same(m, *back));
    }
}

// Every field a message defines, removed and then replaced by a value of the wrong type: each
// is refused with an error naming the field, except the ones documented as optional.
TEST(PeerMessages, MissingAndMistypedFieldsAreNamed) {
    const std::set<std::string> optional = {"error", "code", "top", "verify", "sums"};
    for (const PeerMessage& m : Every()) {
        Json j = Json::parse(Encode(m));
        for (auto& [key, value] : j.items()) {
            if (key == "t") continue;
            if (!optional.count(key)) {
                Json without = j;
                without.erase(key);
                auto r = Decode(without.dump());
                ASSERT_FALSE(r.ok()) << "without '" << key << "': " << without.dump();
                EXPECT_THAT(r.status().message(), HasSubstr("'" + key + "' is missing"))
                    << without.dump();
            }
            Json wrong = j;
            wrong[key] = value.is_string() ? Json(17) : Json("seventeen");
            auto r = Decode(wrong.dump());
            ASSERT_FALSE(r.ok()) << "mistyped '" << key << "': " << wrong.dump();
            EXPECT_THAT(r.status().message(), HasSubstr("'" + key)) << wrong.dump();
        }
    }
}

TEST(PeerMessages, NestedFieldsAreNamedByTheirPath) {
    Json j = Json::parse(Encode(SomeHello(false)));
    j["compat"].erase("layers");
    auto r = Decode(j.dump());
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.status().message(), HasSubstr("field 'compat.layers' is missing"));
    j = Json::parse(Encode(SomeHello(false)));
    j["ranks"][1]["blocks"] = 0;
    r = Decode(j.dump());
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.status().message(), HasSubstr("field 'ranks[1].blocks' = 0 is outside"));
    j = Json::parse(Encode(Claim{"r", kNonce, "l", kPrompt, {1, -2}}));
    r = Decode(j.dump());
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.status().message(), HasSubstr("field 'blocks[1]' = -2 is outside"));
}

TEST(PeerMessages, BadValuesAreRefused) {
    const char* bad[] = {
        "",
        "null",
        "[]",
        "\"claim\"",
        R"({"t": 5})",
        R"({"t": "unheard-of"})",
        R"({"t": "claim", "rid": "r", "nonce": "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "lid": "l",
            "prompt": "0000000000000000000000000000000000000000000000000000000000000000",
            "blocks": []})",
        R"({"t": "claim-ack", "lid": "l", "ok": true, "token": -1, "logprob": 0})",
        R"({"t": "claim-ack", "lid": "l", "ok": true, "token": 1, "logprob": 0, "top": [[1]]})",
        R"({"t": "claim-ack", "lid": "l", "ok": "yes"})",
        R"({"t": "push-target", "xid": "x", "lid": "l", "blocks": [1], "from": 0, "len": 0,
            "prompt": "0000000000000000000000000000000000000000000000000000000000000000"})",
        R"({"t": "push-target", "xid": "x", "lid": "l", "blocks": [1], "from": 18446744073709551615,
            "len": 1, "prompt": "0000000000000000000000000000000000000000000000000000000000000000"})",
        R"({"t": "push-done", "xid": "x", "lid": "l"})",
        R"({"t": "hold-renew", "rid": "r", "nonce": "00000000000000000000000000000000",
            "lease_ms": 0})",
        R"({"t": "hold-renew", "rid": "r", "nonce": "00000000000000000000000000000000",
            "lease_ms": 600001})",
        R"({"t": "push-alive", "xid": "x", "lid": "l", "lease_ms": 0})",
        R"({"t": "push-alive", "xid": "x", "lid": "l"})",
        // --kv-verify: a range that is empty, units out of range, checksums that are not 16
        // lowercase hex digits.
        R"({"t": "push-target", "xid": "x", "lid": "l", "blocks": [1], "from": 0, "len": 1,
            "prompt": "0000000000000000000000000000000000000000000000000000000000000000",
            "verify": {"begin": 4, "end": 4, "units": [0]}})",
        R"({"t": "push-target", "xid": "x", "lid": "l", "blocks": [1], "from": 0, "len": 1,
            "prompt": "0000000000000000000000000000000000000000000000000000000000000000",
            "verify": {"begin": 0, "end": 4, "units": [-1]}})",
        R"({"t": "push-target", "xid": "x", "lid": "l", "blocks": [1], "from": 0, "len": 1,
            "prompt": "0000000000000000000000000000000000000000000000000000000000000000",
            "verify": {"begin": 0, "units": [1]}})",
        R"({"t": "push-done", "xid": "x", "lid": "l", "token": 1, "logprob": 0,
            "sums": ["00000000000000000"]})",
        R"({"t": "push-done", "xid": "x", "lid": "l", "token": 1, "logprob": 0,
            "sums": ["000000000000000A"]})",
        R"({"t": "claim-ack", "lid": "l", "ok": true, "token": 1, "logprob": 0, "sums": [17]})",
        R"([[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]])",
    };
    for (const char* text : bad) {
        auto r = Decode(text);
        EXPECT_FALSE(r.ok()) << text;
        if (!r.ok()) {
            EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << text;
        }
    }
    auto r = Decode(R"({"t": "unheard-of\u0001"})");
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.status().message(), HasSubstr("unknown kv message type 'unheard-of?'"));
}

TEST(PeerMessages, LongStringsAreRefused) {
    Json j = Json::parse(Encode(PushCancel{"x", "l"}));
    j["lid"] = std::string(kMaxIdChars + 1, 'l');
    auto r = Decode(j.dump());
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.status().message(), HasSubstr("field 'lid' is longer than"));
}

// The attention kind: round trips, defaults to gqa when a hello omits it (hellos before MLA),
// is refused when longer than a kind can be, and differs before the model does (an MLA worker
// paired with a GQA one is told that, not that their weights differ).
TEST(PeerMessages, TheAttentionKindRoundTripsDefaultsAndDiffersFirst) {
    Hello h = SomeHello(false);
    h.compat.attention = "mla";
    auto r = Decode(Encode(h));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(std::get<Hello>(*r).compat.attention, "mla");
    Json j = Json::parse(Encode(h));
    j["compat"].erase("attention");
    r = Decode(j.dump());
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(std::get<Hello>(*r).compat.attention, "gqa");
    j["compat"]["attention"] = std::string(17, 'a');
    r = Decode(j.dump());
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(r.status().message(), HasSubstr("attention"));
    Compat a = SomeHello(false).compat, b = a;
    b.attention = "mla";
    b.model = "other";
    auto d = FirstDifference(a, b);
    ASSERT_TRUE(d);
    EXPECT_EQ(d->field, "attention");
    EXPECT_EQ(d->ours, "gqa");
    EXPECT_EQ(d->theirs, "mla");
}

TEST(PeerMessages, InvalidUtf8InAnErrorIsReplacedNotThrown) {
    std::string wire = Encode(PushEnd{PushEnd::Kind::kFailed, "x", "l", std::nullopt, "a\xff"});
    auto r = Decode(wire);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_NE(std::get<PushEnd>(*r).error, "a\xff");
}

TEST(PeerMessages, FirstDifferenceNamesTheFieldAndBothValues) {
    Compat a = SomeHello(false).compat, b = a;
    EXPECT_FALSE(FirstDifference(a, b));
    b.block_tokens = 32;
    b.dtype = "bf16";
    auto d = FirstDifference(a, b);
    ASSERT_TRUE(d);
    EXPECT_EQ(d->field, "dtype");  // the first in the documented order
    EXPECT_EQ(d->ours, "f32");
    EXPECT_EQ(d->theirs, "bf16");
    b = a;
    b.protocol = 1;
    d = FirstDifference(a, b);
    ASSERT_TRUE(d);
    EXPECT_EQ(d->field, "protocol");
    // What a transfer converts is not a difference: TP size and block size.
    b = a;
    b.tp = a.tp * 2;
    b.block_tokens = a.block_tokens * 8;
    EXPECT_FALSE(FirstDifference(a, b));
    for (auto [field, change] : std::vector<std::pair<std::string, std::function<void(Compat&)>>>{
             {"model", [](Compat& c) { c.model = "other"; }},
             {"layers", [](Compat& c) { ++c.layers; }},
             {"kv_heads", [](Compat& c) { ++c.kv_heads; }},
             {"head_dim", [](Compat& c) { ++c.head_dim; }},
             {"dtype", [](Compat& c) { c.dtype = "f16"; }},
             {"layout", [](Compat& c) { c.layout = "NHD"; }}}) {
        b = a;
        change(b);
        d = FirstDifference(a, b);
        ASSERT_TRUE(d) << field;
        EXPECT_EQ(d->field, field);
        EXPECT_NE(d->ours, d->theirs) << field;
    }
}

}  // namespace
}  // namespace ferry::kv::msg
