// The transfer encoder-cache connector between two agents of this process (the process tests
// in tests/disagg/epd_process_test.cc run it between workers): one round trip per pull, leases
// held until every consumer released them or they lapsed, every slot leased refused.
#include "serve/ec_connector.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "testing/testing.h"

namespace ferry::serve {
namespace {

using std::chrono::milliseconds;
using testing::StatusIs;

constexpr size_t kFloats = 3000;  // an entry: 30 rows of 100
constexpr size_t kSlotBytes = 128 + kFloats * sizeof(float);

std::string Hash(char c) { return std::string(64, c); }

std::vector<float> Rows(float seed) {
    std::vector<float> v(kFloats);
    for (size_t i = 0; i < v.size(); ++i) v[i] = seed + 0.001f * static_cast<float>(i);
    return v;
}

class EcTransfer : public ::testing::TestWithParam<std::string> {
  protected:
    // A producer whose buffer holds `slots` entries, and a consumer.
    void Start(size_t slots, milliseconds lease = milliseconds(30000)) {
        testing::AgentPair pair = testing::MakePair(GetParam());
        consumer_agent_ = std::shared_ptr<Agent>(std::move(pair.a));
        producer_agent_ = std::shared_ptr<Agent>(std::move(pair.b));
        EcConnectorConfig p;
        p.kind = "transfer";
        p.producer = true;
        p.agent = producer_agent_;
        p.buffer_bytes = slots * kSlotBytes;
        p.entry_floats = kFloats;
        p.width = 100;
        p.lease = lease;
        producer_ = testing::ValueOrDie(MakeEcConnector(p));
        EcConnectorConfig c;
        c.kind = "transfer";
        c.agent = consumer_agent_;
        c.entry_floats = kFloats;
        c.width = 100;
        consumer_ = testing::ValueOrDie(MakeEcConnector(c));
        source_ = testing::ValueOrDie(schema::ParseEcTransferParams(producer_->Params()));
        ASSERT_EQ(producer_->Stats().slots, slots);
    }

    // Loads `hash` and checks it holds Rows(seed); waits until the producer saw the release.
    void LoadAndRelease(const std::string& hash, float seed) {
        const uint64_t released = producer_->Stats().released;
        media::Embeddings e = testing::ValueOrDie(consumer_->Load(hash, kFloats, &source_));
        EXPECT_EQ(*e, Rows(seed));
        ASSERT_TRUE(
            testing::WaitUntil([&] { return producer_->Stats().released == released + 1; }));
    }

    std::shared_ptr<Agent> consumer_agent_, producer_agent_;
    std::shared_ptr<EcConnector> producer_, consumer_;
    EcSource source_;
};

TEST_P(EcTransfer, OnePullIsOneRoundTripAndItsReleaseOneMessage) {
    Start(4);
    FERRY_ASSERT_OK(producer_->Save(Hash('a'), Rows(1)));
    LoadAndRelease(Hash('a'), 1);  // connects

    FERRY_ASSERT_OK(producer_->Save(Hash('b'), Rows(2)));
    const AgentStats c0 = consumer_agent_->Stats(), p0 = producer_agent_->Stats();
    LoadAndRelease(Hash('b'), 2);
    const AgentStats c1 = consumer_agent_->Stats(), p1 = producer_agent_->Stats();
    // The pull: one request, one reply (its address is never asked for first). Then the
    // release: one notification, not answered.
    EXPECT_EQ(c1.messages_sent - c0.messages_sent, 2u);
    EXPECT_EQ(c1.messages_received - c0.messages_received, 1u);
    EXPECT_EQ(p1.messages_received - p0.messages_received, 2u);
    EXPECT_EQ(p1.messages_sent - p0.messages_sent, 1u);
    const EcConnectorStats s = consumer_->Stats();
    EXPECT_EQ(s.loads, 2u);
    EXPECT_EQ(s.load_bytes, 2 * kFloats * sizeof(float));
    EXPECT_EQ(producer_->Stats().leased, 0u);

    // Not published: a miss, and nothing to release.
    EXPECT_THAT(consumer_->Load(Hash('c'), kFloats, &source_), StatusIs(Code::kNotFound));
    EXPECT_EQ(consumer_->Stats().load_misses, 1u);
    // The wrong shape, a hash that is not one: refused before the wire.
    EXPECT_THAT(consumer_->Load(Hash('a'), kFloats - 1, &source_),
                StatusIs(Code::kInvalidArgument));
    EXPECT_THAT(producer_->Save("not-a-hash", Rows(3)), StatusIs(Code::kInvalidArgument));
    EXPECT_THAT(producer_->Save(Hash('d'), std::vector<float>(kFloats - 1)),
                StatusIs(Code::kInvalidArgument));
}

TEST_P(EcTransfer, EverySlotLeasedIsRefusedUntilAConsumerReleasesOne) {
    Start(2);
    FERRY_ASSERT_OK(producer_->Save(Hash('a'), Rows(1)));
    FERRY_ASSERT_OK(producer_->Save(Hash('b'), Rows(2)));
    // Both slots wait for their consumers: the encode worker answers 503, nothing is overwritten.
    EXPECT_THAT(producer_->Save(Hash('c'), Rows(3)), StatusIs(Code::kResourceExhausted));
    EXPECT_EQ(producer_->Stats().save_refused, 1u);
    EXPECT_EQ(producer_->Stats().leased, 2u);

    LoadAndRelease(Hash('a'), 1);
    FERRY_ASSERT_OK(producer_->Save(Hash('c'), Rows(3)));  // reuses a's slot
    EXPECT_THAT(consumer_->Load(Hash('a'), kFloats, &source_), StatusIs(Code::kNotFound));
    LoadAndRelease(Hash('b'), 2);
    LoadAndRelease(Hash('c'), 3);
    EXPECT_EQ(producer_->Stats().leased, 0u);
    EXPECT_EQ(producer_->Stats().entries, 2u);
}

TEST_P(EcTransfer, ARepeatedImageStaysLeasedUntilEachOfItsConsumersReleasedIt) {
    Start(2);
    // Two requests with the same image: one entry, leased to two consumers.
    FERRY_ASSERT_OK(producer_->Save(Hash('a'), Rows(1)));
    FERRY_ASSERT_OK(producer_->Save(Hash('a'), Rows(1)));
    EXPECT_EQ(producer_->Stats().entries, 1u);
    LoadAndRelease(Hash('a'), 1);  // the first consumer
    FERRY_ASSERT_OK(producer_->Save(Hash('b'), Rows(2)));
    // The second consumer has not pulled 'a' yet: its slot is not free for another image.
    EXPECT_THAT(producer_->Save(Hash('c'), Rows(3)), StatusIs(Code::kResourceExhausted));
    LoadAndRelease(Hash('a'), 1);  // the second consumer finds it whole
    FERRY_ASSERT_OK(producer_->Save(Hash('c'), Rows(3)));
    EXPECT_EQ(producer_->Stats().leased, 2u);  // b and c
}

TEST_P(EcTransfer, LeasesLapseSoNothingWaitsForAConsumerThatNeverCame) {
    Start(2, milliseconds(200));
    FERRY_ASSERT_OK(producer_->Save(Hash('a'), Rows(1)));
    FERRY_ASSERT_OK(producer_->Save(Hash('b'), Rows(2)));
    ASSERT_TRUE(testing::WaitUntil([&] { return producer_->Stats().lapsed == 2; }));
    EXPECT_EQ(producer_->Stats().leased, 0u);
    FERRY_ASSERT_OK(producer_->Save(Hash('c'), Rows(3)));  // reuses a lapsed slot
    LoadAndRelease(Hash('c'), 3);
}

// A consumer whose request waits to load renews the entries' leases: renewed past the
// producer's 0.6 s lease they are still there to pull; a consumer that stops renewing (it died)
// lets a 30 s lease go within its renewal's 0.3 s; a slot leased to two consumers is only ever
// extended by one of them; malformed or foreign renewals change nothing.
TEST_P(EcTransfer, ARenewedLeaseOutlivesItsFirst) {
    Start(3, milliseconds(600));
    FERRY_ASSERT_OK(producer_->Save(Hash('a'), Rows(1)));
    source_.mm_hashes = {Hash('a')};
    LoadAndRelease(Hash('a'), 1);  // connects (renewals go to producers already connected)
    FERRY_ASSERT_OK(producer_->Save(Hash('a'), Rows(1)));
    for (int i = 0; i < 8; ++i) {  // 1.6 s: past the lease twice over
        consumer_->Renew(source_, milliseconds(300));
        std::this_thread::sleep_for(milliseconds(200));
    }
    EXPECT_GE(producer_->Stats().renewed, 8u);
    EXPECT_EQ(producer_->Stats().lapsed, 0u);
    EXPECT_EQ(consumer_->Stats().renewals_sent, 8u);
    LoadAndRelease(Hash('a'), 1);
}

TEST_P(EcTransfer, ALeaseNoLongerRenewedEndsSoonUnlessAnotherConsumerHoldsIt) {
    Start(3);  // a 30 s lease
    FERRY_ASSERT_OK(producer_->Save(Hash('a'), Rows(1)));
    source_.mm_hashes = {Hash('a')};
    LoadAndRelease(Hash('a'), 1);  // connects
    FERRY_ASSERT_OK(producer_->Save(Hash('a'), Rows(1)));
    FERRY_ASSERT_OK(producer_->Save(Hash('b'), Rows(2)));
    FERRY_ASSERT_OK(producer_->Save(Hash('b'), Rows(2)));  // leased to two consumers
    ASSERT_EQ(producer_->Stats().leased, 2u);
    source_.mm_hashes = {Hash('a'), Hash('b'), Hash('c')};  // c: not there, skipped
    const auto renewed = std::chrono::steady_clock::now();
    consumer_->Renew(source_, milliseconds(300));
    // a (one holder) lapses 0.3 s after the renewal, not at 30 s; b (two) keeps its lease.
    ASSERT_TRUE(testing::WaitUntil([&] { return producer_->Stats().lapsed == 1; }));
    EXPECT_LT(std::chrono::steady_clock::now() - renewed, std::chrono::seconds(10));
    EXPECT_EQ(producer_->Stats().leased, 1u);
    std::this_thread::sleep_for(milliseconds(500));
    EXPECT_EQ(producer_->Stats().leased, 1u) << "b is another consumer's too";
    // Renewals that are not one change nothing.
    for (const char* bad : {"ferry-ec-renew:", "ferry-ec-renew:x:aa", "ferry-ec-renew:0:",
                            "ferry-ec-renew:9999999999:bbbb", "ferry-ec-renew:-5:bb"}) {
        FERRY_ASSERT_OK(consumer_agent_->Notify(producer_agent_->name(), bad));
    }
    std::this_thread::sleep_for(milliseconds(300));
    EXPECT_EQ(producer_->Stats().leased, 1u);
    // A producer's own Renew, and a source without hashes, send nothing.
    source_.mm_hashes.clear();
    consumer_->Renew(source_, milliseconds(300));
    EXPECT_EQ(consumer_->Stats().renewals_sent, 1u);
}

TEST_P(EcTransfer, AConsumerThatHadTheImageCachedReleasesItsLeaseWithoutPulling) {
    Start(1);
    FERRY_ASSERT_OK(producer_->Save(Hash('a'), Rows(1)));
    EXPECT_THAT(producer_->Save(Hash('b'), Rows(2)), StatusIs(Code::kResourceExhausted));
    consumer_->Release(Hash('a'), &source_);
    ASSERT_TRUE(testing::WaitUntil([&] { return producer_->Stats().released == 1; }));
    EXPECT_EQ(producer_->Stats().leased, 0u);
    EXPECT_EQ(consumer_->Stats().loads, 0u);
    EXPECT_EQ(consumer_->Stats().released_unpulled, 1u);
    FERRY_ASSERT_OK(producer_->Save(Hash('b'), Rows(2)));
    // Nothing named, or not a hash: nothing sent.
    consumer_->Release(Hash('b'), nullptr);
    consumer_->Release("x", &source_);
    EXPECT_EQ(consumer_->Stats().released_unpulled, 1u);
}

// vLLM's EPD proxy names no encode worker: the consumer asks the deployment's (the store's
// records, or the agents --kv-peers lists) for the image by its hash, one round trip each, and
// takes the first that holds it; none known: a miss that is not expected (encoded locally).
TEST_P(EcTransfer, WithNoEncodeWorkerNamedTheConsumerAsksTheDeploymentsByHash) {
    Start(4);
    FERRY_ASSERT_OK(producer_->Save(Hash('a'), Rows(1)));
    FERRY_ASSERT_OK(producer_->Save(Hash('b'), Rows(2)));
    EcSource unreachable;  // an address nothing listens on, listed first
    unreachable.host = "127.0.0.1";
    unreachable.port = 1;
    EcSource by_address;  // a listed address: taken under the name its agent gives
    by_address.host = source_.host;
    by_address.port = source_.port;
    EcConnectorConfig c;
    c.kind = "transfer";
    c.agent = consumer_agent_;
    c.entry_floats = kFloats;
    c.width = 100;
    c.pull_timeout = milliseconds(2000);
    c.producers = [&] { return std::vector<EcSource>{unreachable, by_address}; };
    auto consumer = testing::ValueOrDie(MakeEcConnector(c));
    EXPECT_TRUE(consumer->FindsWithoutParams());
    media::Embeddings e = testing::ValueOrDie(consumer->Load(Hash('a'), kFloats, nullptr));
    EXPECT_EQ(*e, Rows(1));
    ASSERT_TRUE(testing::WaitUntil([&] { return producer_->Stats().released == 1; }));
    // Not held anywhere it looks: the first other failure (the unreachable agent) is said, so
    // --ec-load-failure decides; with only the producer listed, a plain miss.
    EXPECT_THAT(consumer->Load(Hash('c'), kFloats, nullptr), StatusIs(Code::kUnavailable));
    // The unreachable one is skipped for a while (not dialed per image), still said.
    const AgentStats before = consumer_agent_->Stats();
    EXPECT_THAT(consumer->Load(Hash('c'), kFloats, nullptr), StatusIs(Code::kUnavailable));
    EXPECT_EQ(consumer_agent_->Stats().messages_sent - before.messages_sent, 1u);  // one pull
    EcConnectorConfig only = c;
    only.producers = [&] { return std::vector<EcSource>{source_}; };  // named, as a store has it
    auto named = testing::ValueOrDie(MakeEcConnector(only));
    EXPECT_THAT(named->Load(Hash('c'), kFloats, nullptr), StatusIs(Code::kNotFound));
    e = testing::ValueOrDie(named->Load(Hash('b'), kFloats, nullptr));
    EXPECT_EQ(*e, Rows(2));
    EXPECT_EQ(named->Stats().found_by_hash, 1u);
    EXPECT_EQ(consumer->Stats().found_by_hash, 1u);
    EXPECT_EQ(consumer->Stats().load_failures, 2u);
    // A consumer that knows no encode worker finds nothing without params, and expects nothing.
    EXPECT_FALSE(consumer_->FindsWithoutParams());
    EXPECT_THAT(consumer_->Load(Hash('a'), kFloats, nullptr), StatusIs(Code::kNotFound));
    // Another encoder's entry found by hash is refused, not used.
    EcConnectorConfig foreign = only;
    foreign.encoder = "0123456789abcdef";
    auto other = testing::ValueOrDie(MakeEcConnector(foreign));
    FERRY_ASSERT_OK(producer_->Save(Hash('d'), Rows(4)));
    EXPECT_THAT(other->Load(Hash('d'), kFloats, nullptr), StatusIs(Code::kFailedPrecondition));
}

TEST_P(EcTransfer, AReleaseToAProducerThatIsGoneIsDropped) {
    // The encode worker died after publishing (its lease would have lapsed there): the consumer
    // that found the image cached sends nothing and counts nothing; a pull is an error, not a
    // wait (the request is encoded locally, tests/disagg/epd_process_test.cc).
    Start(1);
    FERRY_ASSERT_OK(producer_->Save(Hash('a'), Rows(1)));
    producer_.reset();
    producer_agent_.reset();
    consumer_->Release(Hash('a'), &source_);
    EXPECT_EQ(consumer_->Stats().released_unpulled, 0u);
    EXPECT_FALSE(consumer_->Load(Hash('a'), kFloats, &source_).ok());
    EXPECT_EQ(consumer_->Stats().load_failures + consumer_->Stats().load_misses, 1u);
}

// Over IPv6 the producer's params name its host without brackets ("::1") and a consumer dials
// "[::1]:port" from them; a consumer with another vision encoder refuses an entry naming both
// fingerprints, before the pull when the params name the encoder and from the slot when they do
// not, and counts it as foreign.
TEST(EcTransferIdentity, OverIpv6AndAnotherEncodersEntriesAreRefusedByName) {
    auto agent = [](const std::string& name) -> std::shared_ptr<Agent> {
        AgentConfig c = testing::TestConfig(name, "tcp");
        c.listen_host = "::1";
        auto a = Agent::Create(c);
        return a.ok() ? std::shared_ptr<Agent>(std::move(*a)) : nullptr;
    };
    std::shared_ptr<Agent> pa = agent("producer6"), ca = agent("consumer6"), oa = agent("other6");
    if (!pa || !ca || !oa) GTEST_SKIP() << "no IPv6 loopback here";
    auto config = [](std::shared_ptr<Agent> a, bool producer, std::string encoder) {
        EcConnectorConfig c;
        c.kind = "transfer";
        c.producer = producer;
        c.agent = std::move(a);
        c.buffer_bytes = 4 * kSlotBytes;
        c.entry_floats = kFloats;
        c.width = 100;
        c.encoder = std::move(encoder);
        return c;
    };
    auto producer = testing::ValueOrDie(MakeEcConnector(config(pa, true, "enc-a")));
    auto consumer = testing::ValueOrDie(MakeEcConnector(config(ca, false, "enc-a")));
    auto other = testing::ValueOrDie(MakeEcConnector(config(oa, false, "enc-b")));
    const EcSource source = testing::ValueOrDie(schema::ParseEcTransferParams(producer->Params()));
    EXPECT_EQ(source.host, "::1");
    EXPECT_EQ(source.encoder, "enc-a");
    FERRY_ASSERT_OK(producer->Save(Hash('a'), Rows(1)));
    media::Embeddings e = testing::ValueOrDie(consumer->Load(Hash('a'), kFloats, &source));
    EXPECT_EQ(*e, Rows(1));

    Result<media::Embeddings> refused = other->Load(Hash('a'), kFloats, &source);
    EXPECT_THAT(refused, StatusIs(Code::kFailedPrecondition));
    EXPECT_THAT(refused.status().message(), ::testing::HasSubstr("enc-a"));
    EXPECT_THAT(refused.status().message(), ::testing::HasSubstr("enc-b"));
    EcSource unnamed = source;
    unnamed.encoder.clear();  // the slot's header still names it
    EXPECT_THAT(other->Load(Hash('a'), kFloats, &unnamed), StatusIs(Code::kFailedPrecondition));
    EXPECT_EQ(other->Stats().load_foreign, 2u);
    EXPECT_EQ(other->Stats().loads, 0u);
}

// The disk connector's files name their image and their encoder: a whole file copied under
// another image's name is refused (DataLoss), one of another encoder too (FailedPrecondition,
// both fingerprints named, the file kept for its writer); its own are loaded.
TEST(EcDisk, AFileOfAnotherImageOrEncoderIsRefusedByName) {
    const std::string dir =
        (std::filesystem::temp_directory_path() / ("ferry-ec-disk-" + std::to_string(getpid())))
            .string();
    std::filesystem::create_directories(dir);
    auto config = [&](bool producer, std::string encoder) {
        EcConnectorConfig c;
        c.kind = "disk";
        c.producer = producer;
        c.dir = dir;
        c.width = 100;
        c.encoder = std::move(encoder);
        return c;
    };
    auto producer = testing::ValueOrDie(MakeEcConnector(config(true, "enc-a")));
    auto consumer = testing::ValueOrDie(MakeEcConnector(config(false, "enc-a")));
    auto other = testing::ValueOrDie(MakeEcConnector(config(false, "enc-b")));
    FERRY_ASSERT_OK(producer->Save(Hash('a'), Rows(1)));
    EXPECT_EQ(*testing::ValueOrDie(consumer->Load(Hash('a'), kFloats, nullptr)), Rows(1));
    Result<media::Embeddings> foreign = other->Load(Hash('a'), kFloats, nullptr);
    EXPECT_THAT(foreign, StatusIs(Code::kFailedPrecondition));
    EXPECT_THAT(foreign.status().message(), ::testing::HasSubstr("enc-a"));
    EXPECT_THAT(foreign.status().message(), ::testing::HasSubstr("enc-b"));
    EXPECT_EQ(other->Stats().load_foreign, 1u);
    // Image a's whole file under image b's name.
    std::filesystem::create_directories(dir + "/" + Hash('b'));
    std::filesystem::copy_file(dir + "/" + Hash('a') + "/encoder_cache.safetensors",
                               dir + "/" + Hash('b') + "/encoder_cache.safetensors");
    Result<media::Embeddings> moved = consumer->Load(Hash('b'), kFloats, nullptr);
    EXPECT_THAT(moved, StatusIs(Code::kDataLoss));
    EXPECT_THAT(moved.status().message(), ::testing::HasSubstr(Hash('a')));
    EXPECT_THAT(consumer->Load(Hash('c'), kFloats, nullptr), StatusIs(Code::kNotFound));
    std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Backends, EcTransfer, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

// Encoder-cache connectors register as KV connectors do: a new kind is found by name and made
// by MakeEcConnector with no change to the worker; the built-in kinds are registered too.
TEST(EcRegistry, AKindRegisteredByNameIsWhatMakeEcConnectorMakes) {
    const std::vector<std::string> names = EcConnectorNames();
    EXPECT_NE(std::find(names.begin(), names.end(), "transfer"), names.end());
    EXPECT_NE(std::find(names.begin(), names.end(), "disk"), names.end());
    EXPECT_TRUE(FindEcConnector("transfer")->needs_agent);
    EXPECT_FALSE(FindEcConnector("disk")->needs_agent);

    struct Null final : EcConnector {
        Null() : EcConnector("null-test") {}
        Status Save(const std::string&, const std::vector<float>&) override { return Status::Ok(); }
        Result<media::Embeddings> Load(const std::string& h, size_t, const EcSource*) override {
            return NotFoundError(h);
        }
        bool Cacheable() const override { return false; }
        nlohmann::json Params() const override { return nullptr; }
        EcConnectorStats Stats() const override { return {}; }
    };
    EcConnectorKind k;
    k.name = "null-test";
    k.description = "drops everything";
    EXPECT_EQ(RegisterEcConnector(k).code(), Code::kInvalidArgument) << "no create";
    int made = 0;
    k.create = [&made](EcConnectorConfig c) -> Result<std::shared_ptr<EcConnector>> {
        ++made;
        EXPECT_EQ(c.kind, "null-test");
        return std::shared_ptr<EcConnector>(std::make_shared<Null>());
    };
    ASSERT_TRUE(RegisterEcConnector(k).ok());
    EXPECT_EQ(RegisterEcConnector(k).code(), Code::kAlreadyExists);
    EcConnectorConfig c;
    c.kind = "null-test";
    auto made_one = MakeEcConnector(c);
    ASSERT_TRUE(made_one.ok()) << made_one.status().ToString();
    EXPECT_EQ((*made_one)->kind(), "null-test");
    EXPECT_EQ(made, 1);
    c.kind = "nope";
    auto unknown = MakeEcConnector(c);
    EXPECT_EQ(unknown.status().code(), Code::kInvalidArgument);
    EXPECT_NE(unknown.status().message().find("null-test"), std::string::npos)
        << unknown.status().ToString();
    EXPECT_NE(unknown.status().message().find("'nope'"), std::string::npos);
    // The built-ins still refuse a config that cannot work, naming the flag.
    c.kind = "disk";
    EXPECT_NE(MakeEcConnector(c).status().message().find("--ec-dir"), std::string::npos);
}

}  // namespace
}  // namespace ferry::serve
