// One suite for every MetadataStore: the embedded store (in this process) and a private etcd
// server that the suite starts on a free loopback port and stops afterwards.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <thread>

#include "discovery/private_etcd.h"
#include "ferry/discovery.h"
#include "testing/process.h"
#include "testing/testing.h"

namespace ferry {
namespace {

using ::ferry::testing::FreePort;
using ::ferry::testing::HaveEtcd;
using ::ferry::testing::PrivateEtcd;
using ::ferry::testing::StatusIs;
using ::ferry::testing::ValueOrDie;
using std::chrono::milliseconds;
using std::chrono::seconds;
using Clock = std::chrono::steady_clock;

class StoreConformance : public ::testing::TestWithParam<std::string> {
  protected:
    static void SetUpTestSuite() {
        if (HaveEtcd()) etcd_ = PrivateEtcd::Start().release();
    }
    static void TearDownTestSuite() {
        delete etcd_;
        etcd_ = nullptr;
    }

    void SetUp() override {
        if (GetParam() == "etcd") {
            ASSERT_TRUE(HaveEtcd()) << "etcd is not installed: run scripts/install-deps";
            ASSERT_NE(etcd_, nullptr) << "the private etcd did not start";
            url_ = etcd_->url();
        } else {
            server_ = ValueOrDie(StoreServer::Start({}));
            url_ = server_->url();
        }
        // Each test its own key space (etcd outlives tests).
        prefix_ = "t/" +
                  std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) +
                  "/";
        for (char& c : prefix_)
            if (c == '/' && &c != &prefix_.back() && &c != &prefix_[1]) c = '_';
        store_ = ValueOrDie(MetadataStore::Open(url_, {}));
    }

    std::unique_ptr<StoreServer> server_;
    std::string url_;
    std::string prefix_;
    std::unique_ptr<MetadataStore> store_;
    static PrivateEtcd* etcd_;
};
PrivateEtcd* StoreConformance::etcd_ = nullptr;

TEST_P(StoreConformance, PutGetListDelete) {
    std::string binary("a\0b\xff\x01", 5);
    FERRY_ASSERT_OK(store_->Put(prefix_ + "x", binary));
    FERRY_ASSERT_OK(store_->Put(prefix_ + "y", "second"));
    FERRY_ASSERT_OK(store_->Put(prefix_ + "x", binary + "!"));  // overwrite
    StoreEntry e = ValueOrDie(store_->Get(prefix_ + "x"));
    EXPECT_EQ(e.key, prefix_ + "x");
    EXPECT_EQ(e.value, binary + "!");
    EXPECT_GT(e.revision, 0u);
    uint64_t rev = 0;
    auto all = ValueOrDie(store_->List(prefix_, &rev));
    ASSERT_EQ(all.size(), 2u);
    EXPECT_EQ(all[0].key, prefix_ + "x");
    EXPECT_EQ(all[1].value, "second");
    EXPECT_GE(rev, e.revision);
    EXPECT_TRUE(ValueOrDie(store_->List(prefix_ + "zzz")).empty());
    FERRY_ASSERT_OK(store_->Delete(prefix_ + "x"));
    EXPECT_THAT(store_->Get(prefix_ + "x"), StatusIs(Code::kNotFound));
    EXPECT_THAT(store_->Delete(prefix_ + "x"), StatusIs(Code::kNotFound));
    EXPECT_EQ(ValueOrDie(store_->List(prefix_)).size(), 1u);
}

TEST_P(StoreConformance, LeaseKeepsEntriesAliveAndTheyGoWhenItLapses) {
    const auto ttl = seconds(2);  // etcd's minimum is about 2 s with default timings
    LeaseId lease = ValueOrDie(store_->GrantLease(ttl));
    FERRY_ASSERT_OK(store_->Put(prefix_ + "a", "1", lease));
    FERRY_ASSERT_OK(store_->Put(prefix_ + "b", "2", lease));
    EXPECT_EQ(ValueOrDie(store_->Get(prefix_ + "a")).lease, lease);
    // Renewed past its TTL, it stays.
    auto until = Clock::now() + seconds(3);
    while (Clock::now() < until) {
        FERRY_ASSERT_OK(store_->KeepAlive(lease));
        std::this_thread::sleep_for(milliseconds(500));
    }
    FERRY_ASSERT_OK(store_->Get(prefix_ + "a").status());
    EXPECT_GT(ValueOrDie(store_->LeaseTimeLeft(lease)).count(), 0);
    // Left alone, its entries are gone within TTL + 1 s (a deadline wait: the entry must be gone
    // by then).
    EXPECT_TRUE(::ferry::testing::WaitUntil([&] { return !store_->Get(prefix_ + "a").ok(); },
                                            ttl + seconds(1) + milliseconds(500)))
        << "the entry outlived its lease by more than 1.5 s";
    EXPECT_THAT(store_->Get(prefix_ + "b"), StatusIs(Code::kNotFound));
    EXPECT_THAT(store_->KeepAlive(lease), StatusIs(Code::kNotFound));
    EXPECT_THAT(store_->Put(prefix_ + "c", "3", lease), StatusIs(Code::kNotFound));
}

TEST_P(StoreConformance, RevokingALeaseDeletesItsEntries) {
    LeaseId lease = ValueOrDie(store_->GrantLease(seconds(30)));
    FERRY_ASSERT_OK(store_->Put(prefix_ + "a", "1", lease));
    FERRY_ASSERT_OK(store_->Put(prefix_ + "keep", "2"));
    FERRY_ASSERT_OK(store_->RevokeLease(lease));
    EXPECT_THAT(store_->Get(prefix_ + "a"), StatusIs(Code::kNotFound));
    FERRY_ASSERT_OK(store_->Get(prefix_ + "keep").status());
    EXPECT_THAT(store_->RevokeLease(lease), StatusIs(Code::kNotFound));
}

TEST_P(StoreConformance, WatchSeesPutsAndDeletesAfterARevision) {
    uint64_t rev = 0;
    ValueOrDie(store_->List(prefix_, &rev));
    // Nothing yet: the long poll returns empty after its timeout.
    auto t0 = Clock::now();
    WatchResult none = ValueOrDie(store_->Watch(prefix_, rev, milliseconds(300)));
    EXPECT_TRUE(none.events.empty());
    EXPECT_GE(Clock::now() - t0, milliseconds(250));
    // A put from another thread wakes it.
    std::thread writer([&] {
        std::this_thread::sleep_for(milliseconds(200));
        auto other = ValueOrDie(MetadataStore::Open(url_, {}));
        FERRY_EXPECT_OK(other->Put(prefix_ + "k", "v1"));
        FERRY_EXPECT_OK(other->Put("elsewhere/" + prefix_, "not watched"));
        FERRY_EXPECT_OK(other->Delete(prefix_ + "k"));
    });
    std::vector<StoreEvent> seen;
    uint64_t after = rev;
    auto end = Clock::now() + seconds(10);
    while (seen.size() < 2 && Clock::now() < end) {
        WatchResult w = ValueOrDie(store_->Watch(prefix_, after, seconds(5)));
        ASSERT_FALSE(w.compacted);
        for (auto& e : w.events) seen.push_back(e);
        after = std::max(after, w.revision);
    }
    writer.join();
    ASSERT_EQ(seen.size(), 2u);
    EXPECT_EQ(seen[0].type, StoreEvent::Type::kPut);
    EXPECT_EQ(seen[0].key, prefix_ + "k");
    EXPECT_EQ(seen[0].value, "v1");
    EXPECT_EQ(seen[1].type, StoreEvent::Type::kDelete);
    EXPECT_LT(seen[0].revision, seen[1].revision);
}

TEST_P(StoreConformance, ASecretIsRequiredAndNeverForged) {
    if (GetParam() == "embedded") {
        StoreServerConfig c;
        c.secret = "s3cret";
        server_ = ValueOrDie(StoreServer::Start(c));
        url_ = server_->url();
        auto none = ValueOrDie(MetadataStore::Open(url_, {}));
        EXPECT_THAT(none->Put("k", "v"), StatusIs(Code::kPermissionDenied));
        EXPECT_THAT(none->List(""), StatusIs(Code::kPermissionDenied));
        auto wrong = ValueOrDie(MetadataStore::Open(url_, {.secret = "guess"}));
        EXPECT_THAT(wrong->Get("k"), StatusIs(Code::kPermissionDenied));
        auto right = ValueOrDie(MetadataStore::Open(url_, {.secret = "s3cret"}));
        FERRY_ASSERT_OK(right->Put("k", "v"));
        EXPECT_EQ(ValueOrDie(right->Get("k")).value, "v");
        return;
    }
    // etcd: values are sealed; one written without (or with another) secret is refused.
    auto right = ValueOrDie(MetadataStore::Open(url_, {.secret = "s3cret"}));
    auto wrong = ValueOrDie(MetadataStore::Open(url_, {.secret = "guess"}));
    FERRY_ASSERT_OK(right->Put(prefix_ + "good", "v"));
    FERRY_ASSERT_OK(wrong->Put(prefix_ + "forged", "evil"));
    FERRY_ASSERT_OK(store_->Put(prefix_ + "plain", "evil"));
    EXPECT_EQ(ValueOrDie(right->Get(prefix_ + "good")).value, "v");
    EXPECT_THAT(right->Get(prefix_ + "forged"), StatusIs(Code::kPermissionDenied));
    EXPECT_THAT(right->Get(prefix_ + "plain"), StatusIs(Code::kPermissionDenied));
    auto listed = ValueOrDie(right->List(prefix_));
    ASSERT_EQ(listed.size(), 1u);
    EXPECT_EQ(listed[0].key, prefix_ + "good");
}

TEST_P(StoreConformance, UnreachableStoreFailsWithUnavailableWithinTheTimeout) {
    std::string url = GetParam() == "etcd" ? "etcd://127.0.0.1:" : "http://127.0.0.1:";
    auto dead = ValueOrDie(
        MetadataStore::Open(url + std::to_string(FreePort()), {.timeout = milliseconds(500)}));
    Status put;
    EXPECT_TRUE(::ferry::testing::FinishesWithin(seconds(3), [&] { put = dead->Put("k", "v"); }))
        << "Put to a dead store outlived its 500 ms timeout by seconds";
    EXPECT_THAT(put, StatusIs(Code::kUnavailable));
}

// etcd with its authentication turned on for the deployment: every call carries a token won
// with a password derived from the secret; calls without one are refused by etcd itself.
TEST(EtcdAuth, EveryCallCarriesProofOfTheSecret) {
    if (!HaveEtcd()) GTEST_SKIP() << "etcd is not installed: run scripts/install-deps";
    auto etcd = PrivateEtcd::Start();
    ASSERT_NE(etcd, nullptr);
    FERRY_ASSERT_OK(SetUpEtcdAuth(etcd->url(), "team", "root-pw"));
    FERRY_ASSERT_OK(SetUpEtcdAuth(etcd->url(), "team", "root-pw"));  // idempotent
    auto right = ValueOrDie(MetadataStore::Open(etcd->url(), {.secret = "team"}));
    LeaseId lease = ValueOrDie(right->GrantLease(seconds(5)));
    FERRY_ASSERT_OK(right->Put("ferry/agents/a", "v", lease));
    EXPECT_EQ(ValueOrDie(right->Get("ferry/agents/a")).value, "v");
    uint64_t rev = 0;
    EXPECT_EQ(ValueOrDie(right->List("ferry/", &rev)).size(), 1u);
    std::thread writer([&] {
        std::this_thread::sleep_for(milliseconds(200));
        FERRY_EXPECT_OK(right->Put("ferry/agents/b", "w"));
    });
    WatchResult w = ValueOrDie(right->Watch("ferry/", rev, seconds(5)));
    writer.join();
    ASSERT_EQ(w.events.size(), 1u);
    EXPECT_EQ(w.events[0].key, "ferry/agents/b");
    FERRY_ASSERT_OK(right->KeepAlive(lease));
    // Outside ferry/ even the right secret has no rights.
    EXPECT_THAT(right->Put("other/x", "v"), StatusIs(Code::kPermissionDenied));

    auto none = ValueOrDie(MetadataStore::Open(etcd->url(), {}));
    EXPECT_THAT(none->Get("ferry/agents/a"), StatusIs(Code::kPermissionDenied));
    EXPECT_THAT(none->Put("ferry/agents/evil", "x"), StatusIs(Code::kPermissionDenied));
    auto wrong = ValueOrDie(MetadataStore::Open(etcd->url(), {.secret = "guess"}));
    Status s = wrong->Put("ferry/agents/evil", "x");
    EXPECT_THAT(s, StatusIs(Code::kPermissionDenied));
    EXPECT_NE(s.message().find("wrong deployment secret"), std::string::npos) << s.ToString();
    EXPECT_THAT(right->Get("ferry/agents/evil"), StatusIs(Code::kNotFound));
}

INSTANTIATE_TEST_SUITE_P(Stores, StoreConformance, ::testing::Values("embedded", "etcd"),
                         [](const auto& info) { return info.param; });

TEST(StoreUrl, BadUrlsAreRefusedWithAMessage) {
    EXPECT_THAT(MetadataStore::Open("localhost:2379"), StatusIs(Code::kInvalidArgument));
    EXPECT_THAT(MetadataStore::Open("ftp://a:1"), StatusIs(Code::kInvalidArgument));
    EXPECT_THAT(MetadataStore::Open("http://a"), StatusIs(Code::kInvalidArgument));
    EXPECT_THAT(MetadataStore::Open("http://a:99999"), StatusIs(Code::kInvalidArgument));
    FERRY_EXPECT_OK(MetadataStore::Open("etcd://[::1]:2379").status());
}

// Raw HTTP against the embedded store: bad input gets a 4xx with a message; it keeps serving.
TEST(EmbeddedStore, MalformedRequestsGetClearErrorsAndTheStoreStaysUp) {
    StoreServerConfig cfg;
    cfg.max_value_bytes = 1024;
    auto server = ValueOrDie(StoreServer::Start(cfg));
    httplib::Client c("127.0.0.1", server->port());
    auto post = [&](const std::string& path, const std::string& body) {
        auto r = c.Post(path, body, "application/json");
        EXPECT_TRUE(r) << path;
        return r ? std::make_pair(r->status, r->body) : std::make_pair(0, std::string());
    };
    auto [s1, b1] = post("/v1/kv/put", "{not json");
    EXPECT_EQ(s1, 400);
    EXPECT_NE(b1.find("not a JSON object"), std::string::npos) << b1;
    auto [s2, b2] = post("/v1/kv/put", R"({"key": 5, "value": "dg=="})");
    EXPECT_EQ(s2, 400);
    EXPECT_NE(b2.find("'key' must be a string"), std::string::npos) << b2;
    auto [s3, b3] = post("/v1/kv/put", R"({"key": "k", "value": "!!!!"})");
    EXPECT_EQ(s3, 400);
    EXPECT_NE(b3.find("base64"), std::string::npos) << b3;
    std::string big(2000, 'A');
    auto [s4, b4] = post("/v1/kv/put", R"({"key": "k", "value": ")" + big + "\"}");
    EXPECT_EQ(s4, 413) << b4;
    auto [s5, b5] = post("/v1/nope", "{}");
    EXPECT_EQ(s5, 404);
    EXPECT_NE(b5.find("no such endpoint"), std::string::npos) << b5;
    auto [s6, b6] = post("/v1/lease/grant", R"({"ttl_ms": -1})");
    EXPECT_EQ(s6, 400) << b6;
    auto [s7, b7] = post("/v1/kv/put", R"({"key": "k", "value": "dg==", "lease": 12345})");
    EXPECT_EQ(s7, 404) << b7;
    auto [s8, b8] = post("/v1/watch", R"({"prefix": "", "after": 0, "timeout_ms": 999999999})");
    EXPECT_EQ(s8, 400) << b8;
    auto [s9, b9] = post("/v1/kv/get", R"({"key": "k", "revison": 3})");
    EXPECT_EQ(s9, 400);
    EXPECT_NE(b9.find("unknown field 'revison'"), std::string::npos) << b9;
    auto [s10, b10] = post("/v1/kv/put", "[1, 2]");
    EXPECT_EQ(s10, 400) << b10;
    // An unknown field whose echo (cut to 64 bytes) splits a UTF-8 character: still a JSON
    // error object, not a 500 from a throwing serializer.
    auto [s11, b11] = post("/v1/kv/get", "{\"" + std::string(63, 'a') + "\u00e9\": 1}");
    EXPECT_EQ(s11, 400) << b11;
    EXPECT_NE(b11.find("unknown field 'aaaa"), std::string::npos) << b11;
    auto store = ValueOrDie(MetadataStore::Open(server->url()));
    FERRY_ASSERT_OK(store->Put("still", "up"));
    EXPECT_EQ(ValueOrDie(store->Get("still")).value, "up");
}

// docs/security.md: the embedded store listens on loopback unless told otherwise.
TEST(EmbeddedStore, ListensOnLoopbackByDefault) {
    std::string ip = testing::NonLoopbackAddress();
    if (ip.empty()) GTEST_SKIP() << "this machine has no non-loopback IPv4 address";
    auto server = ValueOrDie(StoreServer::Start(StoreServerConfig{}));
    EXPECT_EQ(server->url().rfind("http://127.0.0.1:", 0), 0u) << server->url();
    EXPECT_TRUE(testing::CanConnect("127.0.0.1", server->port()));
    EXPECT_FALSE(testing::CanConnect(ip, server->port())) << ip;
}

TEST(EmbeddedStore, SlowClientsAreCutOffAndCannotStarveTheStore) {
    StoreServerConfig cfg;
    cfg.request_deadline = milliseconds(1000);
    auto server = ValueOrDie(StoreServer::Start(cfg));
    // More slow connections than the store has threads (32), each sending a header byte every
    // 200 ms: httplib's per-read timeout (5 s) never fires for them.
    testing::SlowLoris loris(server->port(), 40, milliseconds(200));
    ASSERT_EQ(loris.connected(), 40);
    std::this_thread::sleep_for(milliseconds(300));
    // An honest client is served all the same, within a few seconds.
    StoreOptions options;
    options.timeout = seconds(10);
    auto store = ValueOrDie(MetadataStore::Open(server->url(), options));
    Status put;
    std::string got;
    EXPECT_TRUE(::ferry::testing::FinishesWithin(seconds(8), [&] {
        put = store->Put("k", "v");
        auto e = store->Get("k");
        if (e.ok()) got = e->value;
    })) << "an honest client waited behind the slow ones";
    FERRY_ASSERT_OK(put);
    EXPECT_EQ(got, "v");
    // And every slow connection is closed by the store.
    EXPECT_EQ(loris.WaitClosed(seconds(10)), 40);
}

// docs/security.md "Store bounds": the watch history is bounded in bytes, one key's history
// holds one value, and a deleted key's value is released.
TEST(EmbeddedStore, TheWatchHistoryIsBoundedInBytesAndDeletedValuesAreReleased) {
    // Values of 256 KiB (64 KiB under the sanitizers, where moving them through JSON took
    // most of the time), a history of four of them.
    const size_t value = testing::kSanitized ? 64u << 10 : 256u << 10;
    StoreServerConfig cfg;
    cfg.max_value_bytes = value;
    cfg.history_bytes = 4 * value;
    auto server = ValueOrDie(StoreServer::Start(cfg));
    auto store = ValueOrDie(MetadataStore::Open(server->url()));
    const std::string big(value - 8, 'v');
    for (int i = 0; i < 45; ++i) {
        FERRY_ASSERT_OK(store->Put("one/key", big + std::to_string(i)));
    }
    StoreServerStats st = server->Stats();
    // 45 puts of a value to one key: the history keeps 45 events but one value.
    EXPECT_EQ(st.history_events, 45u);
    EXPECT_LT(st.history_bytes, value + value / 4) << st.history_bytes;
    // A watcher from the start sees the newest value only, not 45 of them.
    WatchResult w = ValueOrDie(store->Watch("one/", 0, milliseconds(0)));
    ASSERT_EQ(w.events.size(), 1u);
    EXPECT_EQ(w.events[0].value, big + "44");
    EXPECT_FALSE(w.compacted);
    FERRY_ASSERT_OK(store->Delete("one/key"));
    EXPECT_LT(server->Stats().history_bytes, value / 4) << "the deleted key's value is held";
    w = ValueOrDie(store->Watch("one/", 0, milliseconds(0)));
    ASSERT_EQ(w.events.size(), 1u);
    EXPECT_EQ(w.events[0].type, StoreEvent::Type::kDelete);
    // Many keys: the byte bound trims the oldest events, and a watcher from before them is
    // told it was compacted (it lists again) rather than served a gap.
    for (int i = 0; i < 12; ++i) {
        FERRY_ASSERT_OK(store->Put("many/" + std::to_string(i), big));
    }
    st = server->Stats();
    EXPECT_LE(st.history_bytes, cfg.history_bytes);
    EXPECT_TRUE(ValueOrDie(store->Watch("many/", 0, milliseconds(0))).compacted);
    EXPECT_EQ(ValueOrDie(store->List("many/")).size(), 12u) << "entries are not history";
}

TEST(EmbeddedStore, WatchesPerClientAreBoundedAndPutsStayFastWhileTheyWait) {
    StoreServerConfig cfg;
    cfg.max_watches_per_client = 40;
    auto server = ValueOrDie(StoreServer::Start(cfg));
    StoreOptions options;
    options.timeout = seconds(10);
    // 40 long polls (each its own connection, none holding a thread of the store).
    std::vector<std::thread> watchers;
    std::atomic<int> woken{0};
    for (int i = 0; i < 40; ++i) {
        watchers.emplace_back([&] {
            auto s = ValueOrDie(MetadataStore::Open(server->url(), options));
            auto w = s->Watch("w/", 0, seconds(20));
            if (w.ok() && !w->events.empty()) ++woken;
        });
    }
    ASSERT_TRUE(testing::WaitUntil([&] { return server->Stats().watches == 40; }, seconds(10)))
        << server->Stats().watches;
    // The 41st from the same client is refused with a reason.
    auto extra = ValueOrDie(MetadataStore::Open(server->url(), options));
    auto refused = extra->Watch("w/", 0, seconds(5));
    EXPECT_THAT(refused, StatusIs(Code::kResourceExhausted));
    EXPECT_NE(refused.status().message().find("watches open"), std::string::npos)
        << refused.status().ToString();
    EXPECT_EQ(server->Stats().watches_refused, 1u);
    // An ordinary put is served at once (it waited 59 s behind 40 watches on a thread pool),
    // and it wakes every watch.
    Status put;
    EXPECT_TRUE(::ferry::testing::FinishesWithin(seconds(5), [&] { put = extra->Put("w/k", "v"); }))
        << "a put waited behind the open watches";
    FERRY_ASSERT_OK(put);
    for (auto& t : watchers) t.join();
    EXPECT_EQ(woken.load(), 40);
    EXPECT_EQ(server->Stats().watches, 0u);
}

TEST(EmbeddedStore, UnauthenticatedConnectionsAreClosedAndTheirBodiesNeverRead) {
    StoreServerConfig cfg;
    cfg.secret = "store-secret";
    cfg.auth_grace = milliseconds(300);
    auto server = ValueOrDie(StoreServer::Start(cfg));
    // Connected and silent: closed after the grace, well before the request deadline (10 s).
    ScopedFd idle = testing::DialLoopback(server->port());
    ASSERT_TRUE(idle.valid());
    EXPECT_TRUE(testing::ClosedWithin(idle.get(), seconds(5)));
    // A head without proof of the secret, announcing 10 MiB: refused before the body is read.
    ScopedFd big = testing::DialLoopback(server->port());
    ASSERT_TRUE(testing::SendAll(big.get(),
                                 "POST /v1/kv/put HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                 "application/json\r\nContent-Length: 10485760\r\n\r\n"));
    std::string got;
    EXPECT_TRUE(testing::ClosedWithin(big.get(), seconds(5), &got));
    EXPECT_EQ(got.rfind("HTTP/1.1 401", 0), 0u) << got;
    EXPECT_NE(got.find("no Authorization header"), std::string::npos) << got;
    // A forged proof: 401 and the connection closes.
    auto forged = ValueOrDie(MetadataStore::Open(server->url(), StoreOptions{.secret = "guess"}));
    EXPECT_THAT(forged->Put("k", "v"), StatusIs(Code::kPermissionDenied));
    // The honest client is served.
    auto honest =
        ValueOrDie(MetadataStore::Open(server->url(), StoreOptions{.secret = "store-secret"}));
    FERRY_ASSERT_OK(honest->Put("k", "v"));
    EXPECT_GE(server->Stats().unauthorized, 2u);
}

TEST(EmbeddedStore, AValidatorRefusesBadValuesWithItsMessage) {
    StoreServerConfig cfg;
    cfg.validate = [](std::string_view key, std::string_view value) -> Status {
        if (value.substr(0, 4) != "FRMD") return InvalidArgumentError("not a metadata blob");
        return Status::Ok();
    };
    auto server = ValueOrDie(StoreServer::Start(cfg));
    auto store = ValueOrDie(MetadataStore::Open(server->url()));
    Status s = store->Put("ferry/agents/x", "garbage");
    EXPECT_THAT(s, StatusIs(Code::kInvalidArgument));
    EXPECT_NE(s.message().find("not a metadata blob"), std::string::npos) << s.ToString();
    EXPECT_THAT(store->Get("ferry/agents/x"), StatusIs(Code::kNotFound));
    FERRY_ASSERT_OK(store->Put("ferry/agents/x", "FRMD..."));
}

}  // namespace
}  // namespace ferry
